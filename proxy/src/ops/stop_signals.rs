//! The stop signals (SIGTERM, SIGQUIT, SIGINT) and SIGHUP, taken from before the gateway starts.
//! pingora's own watch registers its handlers only when its main loop begins, after the listeners
//! serve and the event threads run: a SIGTERM in between (a pod stopped just after it was ready, a
//! test that stopped a gateway it had just started) ended the process by the signal's default
//! action, with no graceful stop: the open minute's usage never metered, the leases left held until
//! they expired, an exit by signal instead of 0. Registered here first, a signal that comes early
//! waits in a channel until the main loop asks for it. SIGHUP (the reloader's, registered when its
//! service starts) is taken here too, so that one sent while the gateway starts (a deploy tool's
//! reload right after its start) is ignored instead of ending it: the files it would reload are
//! being read then anyway. A stop or an upgrade also begins the drain ([`Draining`]) the moment
//! pingora's main loop takes its signal.

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::{mpsc, Mutex};

use crate::http::draining::Draining;

/// The stop signals as pingora's main loop asks for them; see the module's doc.
pub struct StopSignals {
    received: Mutex<mpsc::UnboundedReceiver<ShutdownSignal>>,
    draining: Draining,
}

impl StopSignals {
    /// Registers the handlers now, on a thread of their own (a current-thread runtime: the
    /// server's runtimes do not exist yet), and returns once they are in place.
    pub fn register() -> std::io::Result<StopSignals> {
        let (sender, received) = mpsc::unbounded_channel();
        let (registered, in_place) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("stop signals".into())
            .spawn(move || forward(sender, registered))?;
        in_place
            .recv()
            .map_err(|_| std::io::Error::other("the stop signals' thread ended"))??;
        Ok(StopSignals {
            received: Mutex::new(received),
            draining: Draining::default(),
        })
    }

    /// The drain these signals begin, for the request path.
    pub fn draining(&self) -> Draining {
        self.draining.clone()
    }
}

/// Forwards each stop signal until no one listens: the thread's whole life.
fn forward(
    sender: mpsc::UnboundedSender<ShutdownSignal>,
    registered: std::sync::mpsc::Sender<std::io::Result<()>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return drop(registered.send(Err(e))),
    };
    runtime.block_on(async move {
        let mut signals = match handlers() {
            Ok(signals) => signals,
            Err(e) => return drop(registered.send(Err(e))),
        };
        let _ = registered.send(Ok(()));
        let [quit, terminate, interrupt] = &mut signals;
        loop {
            let received = tokio::select! {
                _ = quit.recv() => ShutdownSignal::GracefulUpgrade,
                _ = terminate.recv() => ShutdownSignal::GracefulTerminate,
                _ = interrupt.recv() => ShutdownSignal::FastShutdown,
            };
            if sender.send(received).is_err() {
                return;
            }
        }
    });
}

/// pingora's meanings: SIGQUIT hands the sockets over (an upgrade), SIGTERM stops gracefully,
/// SIGINT at once. SIGHUP's handler is installed and its stream dropped: tokio keeps a handler
/// for the process's life, so an early SIGHUP is ignored, and the reloader's own stream gets
/// the later ones.
fn handlers() -> std::io::Result<[Signal; 3]> {
    drop(signal(SignalKind::hangup())?);
    Ok([
        signal(SignalKind::quit())?,
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    ])
}

#[async_trait]
impl ShutdownSignalWatch for StopSignals {
    async fn recv(&self) -> ShutdownSignal {
        let signal = match self.received.lock().await.recv().await {
            Some(received) => received,
            // The thread cannot end while this end is held but by a panic; should it, stop
            // rather than run on deaf to every signal.
            None => {
                tracing::error!("the stop signals' thread ended; stopping the gateway");
                ShutdownSignal::GracefulTerminate
            }
        };
        if self.draining.begin() {
            tracing::info!(signal = ?signal,
                "draining: every answer from now on closes its connection");
        }
        signal
    }
}
