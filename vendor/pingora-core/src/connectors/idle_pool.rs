// Copyright 2026 Cloudflare, Inc.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//! The keep-alive pool of idle upstream streams, without a task per idle stream.
//!
//! `pingora_pool::ConnectionPool` spawns a task for every stream it takes back (on a runtime
//! picked at random), which waits on the stream, an eviction `Notify` and a `oneshot` that the
//! next user fires; that user then waits for the task to hand the stream over. Every reuse so
//! costs a spawn, two channels, an LRU entry and, across runtimes, two cross-thread wakes.
//!
//! Here an idle stream is a plain entry in a list. What the task watched for is checked when
//! it matters instead:
//! - a stream the server closed, or wrote to, is found by [`super::test_reusable_stream`] when
//!   the stream is taken (the reactor keeps recording a registered socket's readiness whether
//!   or not anyone waits on it, so the check needs no system call while nothing happened). As
//!   with the old pool's watcher, a close is seen once the stream's reactor has turned after it:
//!   one that crosses the request on the wire is not;
//! - an idle timeout is a deadline compared when the stream is taken;
//! - one sweeper task a pool, alive only while the pool holds streams, closes every
//!   [`SWEEP_EVERY`] the streams that timed out or were closed by their server, so that their
//!   sockets do not wait for the next request to be freed, and forgets peers left with none.
//!
//! The pool is sharded by thread: a thread takes back the streams it released first. With
//! pingora's runtimes of one thread each, a stream mostly stays with the runtime whose reactor
//! it is registered with, so its reads wake the task on the same thread. Only mostly: a thread
//! whose shard has none takes another's, and past [`SHARDS`] threads share shards. The
//! capacity is one for the whole pool (pingora sizes it as its setting × threads).

use super::{test_reusable_stream, PoolCallback};
use crate::protocols::Stream;
use parking_lot::Mutex;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shards of the pool. Threads are given one each in turn (modulo this count).
const SHARDS: usize = 16;

/// How often the sweeper closes timed-out and server-closed idle streams.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Idle {
    stream: Stream,
    since: Instant,
    expires: Option<Instant>,
    /// Release order across the pool: the smallest is the least recently released.
    seq: u64,
}

impl Idle {
    fn expired(&self, now: Instant) -> bool {
        self.expires.is_some_and(|at| now >= at)
    }
}

/// The group keys are already hashes of a peer (`Peer::reuse_hash`): hashing them again would
/// only cost time.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Groups = HashMap<u64, VecDeque<Idle>, BuildHasherDefault<KeyHasher>>;

#[derive(Default)]
struct Shard {
    /// Each peer's idle streams, the most recently released last (taken first).
    groups: Groups,
}

impl Shard {
    /// The release order and peer key of this shard's least recently released stream.
    fn oldest(&self) -> Option<(u64, u64)> {
        self.groups
            .iter()
            .filter_map(|(k, q)| q.front().map(|i| (i.seq, *k)))
            .min()
    }

    /// Takes out the least recently released stream of this shard.
    fn pop_oldest(&mut self) -> Option<Idle> {
        let (_, key) = self.oldest()?;
        self.groups.get_mut(&key)?.pop_front()
    }
}

thread_local! {
    static SHARD_OF_THREAD: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

/// This thread's shard, given in turn at its first use.
fn own_shard() -> usize {
    SHARD_OF_THREAD.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(i);
        }
        i
    })
}

pub(crate) struct IdlePool {
    shards: Box<[Mutex<Shard>]>,
    capacity: usize,
    /// Idle streams held, all shards together.
    held: AtomicUsize,
    seq: AtomicU64,
    /// Whether a sweeper task runs for this pool.
    sweeping: AtomicBool,
    unexpected_data: Arc<AtomicU64>,
    on_evict: Option<PoolCallback>,
}

impl IdlePool {
    pub(crate) fn new(
        capacity: usize,
        unexpected_data: Arc<AtomicU64>,
        on_evict: Option<PoolCallback>,
    ) -> Self {
        IdlePool {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            capacity,
            held: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            sweeping: AtomicBool::new(false),
            unexpected_data,
            on_evict,
        }
    }

    /// Idle streams held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// A reusable stream to the peer of `key`: this thread's own first, the most recently
    /// released first. Streams found timed out, closed or with unexpected data are closed.
    pub(crate) fn take(&self, key: u64) -> Option<Stream> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let own = own_shard();
        let now = Instant::now();
        for i in (0..SHARDS).map(|k| (own + k) % SHARDS) {
            loop {
                let idle = self.shards[i]
                    .lock()
                    .groups
                    .get_mut(&key)
                    .and_then(|q| q.pop_back());
                let Some(mut idle) = idle else { break };
                self.held.fetch_sub(1, Ordering::SeqCst);
                if !idle.expired(now)
                    && test_reusable_stream(&mut idle.stream, &self.unexpected_data)
                {
                    return Some(idle.stream);
                }
                // dropped here, outside the lock: closed
            }
        }
        None
    }

    /// Keeps `stream` for the peer of `key` until `idle_timeout` (None: until its server closes
    /// it or the pool needs its room). Past the pool's capacity the least recently released
    /// stream is closed to make room.
    pub(crate) fn put(self: &Arc<Self>, key: u64, stream: Stream, idle_timeout: Option<Duration>) {
        if self.capacity == 0 {
            return;
        }
        let now = Instant::now();
        let idle = Idle {
            stream,
            since: now,
            expires: idle_timeout.map(|t| now + t),
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
        };
        let own = own_shard();
        let full = {
            let mut shard = self.shards[own].lock();
            shard.groups.entry(key).or_default().push_back(idle);
            self.held.fetch_add(1, Ordering::SeqCst) >= self.capacity
        };
        if let Some(e) = full.then(|| self.pop_least_recent()).flatten() {
            self.held.fetch_sub(1, Ordering::SeqCst);
            if let Some(cb) = &self.on_evict {
                cb(e.since.elapsed());
            }
        }
        self.ensure_sweeper();
    }

    /// Takes out the least recently released stream of the whole pool (the shards' oldest
    /// compared one lock at a time: a stream released meanwhile is younger anyway).
    fn pop_least_recent(&self) -> Option<Idle> {
        let (_, i) = (0..SHARDS)
            .filter_map(|i| self.shards[i].lock().oldest().map(|(seq, _)| (seq, i)))
            .min()?;
        self.shards[i].lock().pop_oldest()
    }

    /// Starts the sweeper on the current runtime unless one runs. Without a runtime (a pool used
    /// outside one) nothing is swept, and streams are still checked when taken.
    fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeping.load(Ordering::SeqCst) || self.sweeping.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::SeqCst);
            return;
        };
        let pool = Arc::downgrade(self);
        // Made here, not in the task: a task dropped before its first poll (its runtime shut
        // down) must clear the flag too.
        let guard = SweeperRunning(pool.clone());
        rt.spawn(async move {
            let mut running = guard;
            loop {
                pingora_timeout::sleep(SWEEP_EVERY).await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep();
                if pool.held.load(Ordering::SeqCst) == 0 {
                    // Stop; a put that raced with this either saw `sweeping` still set and left
                    // its stream to this loop (seen here on the re-check), or starts a new one.
                    pool.sweeping.store(false, Ordering::SeqCst);
                    if pool.held.load(Ordering::SeqCst) == 0
                        || pool.sweeping.swap(true, Ordering::SeqCst)
                    {
                        running.0 = std::sync::Weak::new(); // stopped by its own decision
                        return;
                    }
                }
            }
        });
    }

    /// Closes the idle streams that timed out or that their server closed or wrote to, and
    /// forgets peers with no idle stream left.
    pub(crate) fn sweep(&self) {
        let now = Instant::now();
        for shard in self.shards.iter() {
            let mut closed = Vec::new();
            {
                let mut shard = shard.lock();
                shard.groups.retain(|_, q| {
                    let mut i = 0;
                    while i < q.len() {
                        let idle = &mut q[i];
                        if idle.expired(now)
                            || !test_reusable_stream(&mut idle.stream, &self.unexpected_data)
                        {
                            closed.extend(q.remove(i));
                            self.held.fetch_sub(1, Ordering::SeqCst);
                        } else {
                            i += 1;
                        }
                    }
                    !q.is_empty()
                });
            }
            // `closed` dropped here, outside the lock: the sockets close
        }
    }
}

/// Clears the pool's `sweeping` flag when the sweeper task ends in any way other than its own
/// decision to stop (its runtime shutting down drops it), so that the next put starts another.
struct SweeperRunning(std::sync::Weak<IdlePool>);

impl Drop for SweeperRunning {
    fn drop(&mut self) {
        if let Some(pool) = self.0.upgrade() {
            pool.sweeping.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::l4::stream::Stream as L4Stream;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connected pair: the pool's side as a `Stream`, and the server's side.
    async fn pair(listener: &TcpListener) -> (Stream, TcpStream) {
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let client: Stream = Box::new(L4Stream::from(client.unwrap()));
        (client, server.unwrap().0)
    }

    fn pool(capacity: usize) -> Arc<IdlePool> {
        Arc::new(IdlePool::new(capacity, Arc::new(AtomicU64::new(0)), None))
    }

    /// Whether the server's side sees the pool's side closed within `within`.
    async fn closed_within(server: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1];
        matches!(
            tokio::time::timeout(within, server.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    #[tokio::test]
    async fn the_most_recently_released_stream_is_taken_first() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(8);
        let ((a, _sa), (b, _sb)) = (pair(&listener).await, pair(&listener).await);
        let (ida, idb) = (a.id(), b.id());
        pool.put(7, a, None);
        pool.put(7, b, None);
        assert!(
            pool.take(8).is_none(),
            "another peer's streams are not taken"
        );
        assert_eq!(pool.take(7).unwrap().id(), idb);
        assert_eq!(pool.take(7).unwrap().id(), ida);
        assert!(pool.take(7).is_none());
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn a_stream_its_server_closed_is_closed_not_taken() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(8);
        let (a, server) = pair(&listener).await;
        pool.put(7, a, None);
        drop(server);
        tokio::time::sleep(Duration::from_millis(50)).await; // the reactor sees the FIN
        assert!(pool.take(7).is_none());
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn a_stream_its_server_wrote_to_is_closed_and_counted() {
        use tokio::io::AsyncWriteExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let counter = Arc::new(AtomicU64::new(0));
        let pool = Arc::new(IdlePool::new(8, counter.clone(), None));
        let (a, mut server) = pair(&listener).await;
        pool.put(7, a, None);
        server
            .write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take(7).is_none());
        assert_eq!(counter.load(Ordering::Relaxed), 1);
        assert!(closed_within(&mut server, Duration::from_secs(1)).await);
    }

    #[tokio::test]
    async fn a_stream_past_its_idle_timeout_is_not_taken() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(8);
        let ((a, _sa), (b, _sb)) = (pair(&listener).await, pair(&listener).await);
        let ida = a.id();
        pool.put(7, a, None);
        pool.put(7, b, Some(Duration::from_millis(20)));
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(
            pool.take(7).unwrap().id(),
            ida,
            "the timed-out one is passed over"
        );
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn past_capacity_the_least_recently_released_is_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let evicted = Arc::new(AtomicUsize::new(0));
        let seen = evicted.clone();
        let on_evict: PoolCallback = Arc::new(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        });
        let pool = Arc::new(IdlePool::new(
            2,
            Arc::new(AtomicU64::new(0)),
            Some(on_evict),
        ));
        let (a, mut sa) = pair(&listener).await;
        let ((b, _sb), (c, _sc)) = (pair(&listener).await, pair(&listener).await);
        let (idb, idc) = (b.id(), c.id());
        pool.put(1, a, None);
        pool.put(2, b, None);
        pool.put(1, c, None);
        assert_eq!(pool.len(), 2);
        assert_eq!(evicted.load(Ordering::SeqCst), 1);
        assert!(
            closed_within(&mut sa, Duration::from_secs(1)).await,
            "the oldest is closed"
        );
        assert_eq!(pool.take(1).unwrap().id(), idc);
        assert!(pool.take(1).is_none());
        assert_eq!(pool.take(2).unwrap().id(), idb);
    }

    #[tokio::test]
    async fn a_pool_of_no_capacity_keeps_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(0);
        let (a, mut server) = pair(&listener).await;
        pool.put(7, a, None);
        assert!(pool.take(7).is_none());
        assert!(closed_within(&mut server, Duration::from_secs(1)).await);
    }

    #[tokio::test]
    async fn the_sweeper_closes_idle_streams_that_timed_out_or_were_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(8);
        let ((a, mut sa), (b, sb)) = (pair(&listener).await, pair(&listener).await);
        let (c, _sc) = pair(&listener).await;
        pool.put(7, a, Some(Duration::from_millis(100)));
        pool.put(7, b, None);
        pool.put(8, c, None);
        drop(sb);
        // Nothing takes a stream: only the sweeper can close them.
        let within = SWEEP_EVERY * 2 + Duration::from_millis(500);
        assert!(
            closed_within(&mut sa, within).await,
            "the timed-out stream is closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            pool.len(),
            1,
            "the server-closed one is gone, the live one kept"
        );
        assert!(pool.take(7).is_none());
        assert!(pool.take(8).is_some());
    }

    #[tokio::test]
    async fn the_sweeper_stops_when_the_pool_is_empty_and_starts_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = pool(8);
        let (a, _sa) = pair(&listener).await;
        pool.put(7, a, Some(Duration::from_millis(10)));
        assert!(pool.sweeping.load(Ordering::SeqCst));
        tokio::time::sleep(SWEEP_EVERY * 2 + Duration::from_millis(300)).await;
        assert_eq!(pool.len(), 0);
        assert!(
            !pool.sweeping.load(Ordering::SeqCst),
            "an empty pool has no sweeper"
        );
        let (b, mut sb) = pair(&listener).await;
        pool.put(7, b, Some(Duration::from_millis(10)));
        assert!(
            pool.sweeping.load(Ordering::SeqCst),
            "a new stream starts one again"
        );
        assert!(closed_within(&mut sb, SWEEP_EVERY * 2 + Duration::from_millis(500)).await);
    }

    #[test]
    fn a_thread_takes_back_the_streams_it_released_first() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let ((a, _sa), (b, _sb)) =
            rt.block_on(async { (pair(&listener).await, pair(&listener).await) });
        let (ida, idb) = (a.id(), b.id());
        let pool = pool(8);
        // This thread is shard 3, another thread shard 4; each releases one stream, this one
        // first, so the other thread's is the most recently released of the pool.
        SHARD_OF_THREAD.with(|s| s.set(3));
        rt.block_on(async { pool.put(7, a, None) });
        let other = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                SHARD_OF_THREAD.with(|s| s.set(4));
                pool.put(7, b, None);
            })
        };
        other.join().unwrap();
        assert_eq!(
            pool.take(7).unwrap().id(),
            ida,
            "this thread's own comes first"
        );
        assert_eq!(pool.take(7).unwrap().id(), idb, "then another thread's");
    }

    #[test]
    fn a_sweeper_dropped_before_it_ran_lets_the_next_put_start_another() {
        let pool = pool(8);
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = first.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let (a, _sa) = first.block_on(pair(&listener));
        // The sweeper is spawned on `first`, which is dropped before it ever polls it.
        first.block_on(async { pool.put(7, a, None) });
        drop((first, listener));
        assert!(
            !pool.sweeping.load(Ordering::SeqCst),
            "the dropped task cleared the flag"
        );
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let (b, mut sb) = pair(&listener).await;
            pool.put(7, b, Some(Duration::from_millis(10)));
            let within = SWEEP_EVERY * 2 + Duration::from_millis(500);
            assert!(
                closed_within(&mut sb, within).await,
                "a new sweeper closes it"
            );
        });
    }

    #[test]
    fn past_capacity_the_oldest_of_the_whole_pool_goes_whichever_shard_holds_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let (a, mut sa) = rt.block_on(pair(&listener));
        let ((b, _sb), (c, _sc)) =
            rt.block_on(async { (pair(&listener).await, pair(&listener).await) });
        let (idb, idc) = (b.id(), c.id());
        let pool = pool(2);
        let other = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                SHARD_OF_THREAD.with(|s| s.set(5));
                pool.put(7, a, None); // the oldest, in shard 5
            })
        };
        other.join().unwrap();
        SHARD_OF_THREAD.with(|s| s.set(6));
        rt.block_on(async {
            pool.put(7, b, None);
            pool.put(7, c, None); // full: shard 5's stream goes, not this shard's older one
            assert!(closed_within(&mut sa, Duration::from_secs(1)).await);
        });
        assert_eq!(pool.len(), 2);
        assert_eq!(pool.take(7).unwrap().id(), idc);
        assert_eq!(pool.take(7).unwrap().id(), idb);
    }

    #[test]
    fn the_count_of_held_streams_stays_true_under_threads_putting_and_taking() {
        let pool = pool(6);
        let threads: Vec<_> = (0..4)
            .map(|n| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                        let mut held = Vec::new();
                        for _ in 0..3 {
                            held.push(pair(&listener).await);
                        }
                        let mut servers = Vec::new();
                        for round in 0..2000u32 {
                            let key = u64::from(round % 3);
                            if let Some((s, server)) = held.pop() {
                                pool.put(key, s, None);
                                servers.push(server);
                            } else if let Some(s) = pool.take(key) {
                                let server = match servers.pop() {
                                    Some(server) => server,
                                    None => pair(&listener).await.1,
                                };
                                held.push((s, server));
                            }
                            if round % 7 == n {
                                if let Some(s) = pool.take(key) {
                                    drop(s);
                                }
                            }
                            if round % 64 == 0 {
                                tokio::task::yield_now().await;
                            }
                        }
                        servers
                    })
                })
            })
            .collect();
        let servers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let inside: usize = pool
            .shards
            .iter()
            .map(|s| s.lock().groups.values().map(VecDeque::len).sum::<usize>())
            .sum();
        assert_eq!(pool.len(), inside, "the count is what the shards hold");
        assert!(inside <= 6, "never past the capacity: {inside}");
        drop(servers);
    }
}
