//! Pets on SQLite. SQLite calls block, so none of them runs on an async worker thread:
//! writes go to one dedicated writer thread that commits whatever creates are waiting in a
//! single transaction (group commit: one fsync for a burst of creates), and reads run on tokio's
//! blocking pool over a small set of read connections, which WAL lets proceed beside the writer.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::{mpsc, oneshot};

use crate::pet::{NewPet, Pet, PetStatus};
use crate::query::ListQuery;

/// Most creates committed in one transaction; bounds the latency a large burst adds to its
/// first member.
const MAX_BATCH: usize = 256;
/// Creates that may wait for the writer before callers are made to wait for room.
const QUEUE_DEPTH: usize = 4096;
/// Read connections kept open between requests.
const MAX_IDLE_READERS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create the database directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the database {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("the database writer has stopped")]
    WriterGone,
    #[error("database task failed: {0}")]
    Task(String),
    #[error("the database holds a status the interface does not know: {0:?}")]
    BadStatus(String),
}

/// One page of `GET /pets`: the pets, and whether more follow the last of them.
#[derive(Debug)]
pub struct Page {
    pub pets: Vec<Pet>,
    pub has_more: bool,
}

struct CreateJob {
    pet: NewPet,
    reply: oneshot::Sender<Result<Pet, StoreError>>,
}

/// Cheap to clone; all clones share the writer thread and the read connections.
#[derive(Clone)]
pub struct PetStore {
    writer: mpsc::Sender<CreateJob>,
    readers: Arc<ReaderPool>,
}

impl PetStore {
    /// Opens (creating if needed) the database at `path` and starts its writer thread.
    pub fn open(path: &Path) -> Result<PetStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let open_err = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let writer_conn = Connection::open(path).map_err(open_err)?;
        configure(&writer_conn).map_err(open_err)?;
        migrate(&writer_conn).map_err(open_err)?;

        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || writer_loop(writer_conn, rx))
            .map_err(|e| StoreError::Task(format!("cannot start the writer thread: {e}")))?;

        Ok(PetStore {
            writer: tx,
            readers: Arc::new(ReaderPool {
                path: path.to_owned(),
                idle: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Returns once the pet is committed to disk (WAL with `synchronous=FULL`), so a 201 built
    /// from it survives a crash of the process or the machine.
    pub async fn create(&self, pet: NewPet) -> Result<Pet, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.writer
            .send(CreateJob { pet, reply })
            .await
            .map_err(|_| StoreError::WriterGone)?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    pub async fn get(&self, id: i64) -> Result<Option<Pet>, StoreError> {
        self.read(move |conn| {
            conn.prepare_cached("SELECT id, name, category_id, status FROM pets WHERE id = ?1")?
                .query_row([id], row_to_raw)
                .optional()
                .map_err(StoreError::from)
                .and_then(|raw| raw.map(RawPet::into_pet).transpose())
        })
        .await
    }

    pub async fn list(&self, q: ListQuery) -> Result<Page, StoreError> {
        self.read(move |conn| {
            // One row beyond the page tells whether a next page exists without a COUNT.
            let fetch = i64::from(q.limit) + 1;
            let raws = match &q.status {
                None => conn
                    .prepare_cached(
                        "SELECT id, name, category_id, status FROM pets
                         WHERE id > ?1 ORDER BY id LIMIT ?2",
                    )?
                    .query_map(params![q.after, fetch], row_to_raw)?
                    .collect::<Result<Vec<_>, _>>()?,
                Some(status) => conn
                    .prepare_cached(
                        "SELECT id, name, category_id, status FROM pets
                         WHERE status = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
                    )?
                    .query_map(params![status.as_str(), q.after, fetch], row_to_raw)?
                    .collect::<Result<Vec<_>, _>>()?,
            };
            let mut pets = raws
                .into_iter()
                .map(RawPet::into_pet)
                .collect::<Result<Vec<_>, _>>()?;
            let has_more = pets.len() > q.limit as usize;
            pets.truncate(q.limit as usize);
            Ok(Page { pets, has_more })
        })
        .await
    }

    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let readers = Arc::clone(&self.readers);
        tokio::task::spawn_blocking(move || {
            let conn = readers.take()?;
            let result = f(&conn);
            readers.give_back(conn);
            result
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
    }
}

struct ReaderPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl ReaderPool {
    fn take(&self) -> Result<Connection, StoreError> {
        if let Some(conn) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(conn);
        }
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| StoreError::Open {
            path: self.path.clone(),
            source,
        })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Ok(conn)
    }

    fn give_back(&self, conn: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
    }
}

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    // WAL lets readers run beside the writer; FULL makes every commit durable before it returns.
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::warn!(%mode, "SQLite refused WAL mode; reads will wait for writes");
    }
    conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")
}

/// Schema versions go through `user_version`, so a later change can upgrade old files in place.
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version < 1 {
        conn.execute_batch(
            "BEGIN;
             CREATE TABLE IF NOT EXISTS pets (
                 id          INTEGER PRIMARY KEY AUTOINCREMENT,
                 name        TEXT    NOT NULL,
                 category_id INTEGER NOT NULL CHECK (category_id >= 1),
                 status      TEXT    NOT NULL CHECK (status IN ('available', 'pending', 'sold'))
             );
             CREATE INDEX IF NOT EXISTS pets_by_status ON pets (status, id);
             PRAGMA user_version = 1;
             COMMIT;",
        )?;
    }
    Ok(())
}

fn writer_loop(mut conn: Connection, mut rx: mpsc::Receiver<CreateJob>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        match insert_batch(&mut conn, &batch) {
            Ok(pets) => {
                for (job, pet) in batch.drain(..).zip(pets) {
                    let _ = job.reply.send(Ok(pet));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, creates = batch.len(), "committing creates failed");
                let message = e.to_string();
                for job in batch.drain(..) {
                    let _ = job
                        .reply
                        .send(Err(StoreError::Task(format!("commit failed: {message}"))));
                }
            }
        }
    }
}

fn insert_batch(conn: &mut Connection, batch: &[CreateJob]) -> rusqlite::Result<Vec<Pet>> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let mut pets = Vec::with_capacity(batch.len());
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO pets (name, category_id, status) VALUES (?1, ?2, ?3) RETURNING id",
        )?;
        for job in batch {
            let p = &job.pet;
            let id: i64 = insert
                .query_row(params![p.name, p.category_id, p.status.as_str()], |r| {
                    r.get(0)
                })?;
            pets.push(Pet {
                id,
                name: p.name.clone(),
                category_id: p.category_id,
                status: p.status.clone(),
            });
        }
    }
    tx.commit()?;
    Ok(pets)
}

struct RawPet {
    id: i64,
    name: String,
    category_id: i64,
    status: String,
}

impl RawPet {
    fn into_pet(self) -> Result<Pet, StoreError> {
        let status = PetStatus::parse(&self.status).ok_or(StoreError::BadStatus(self.status))?;
        Ok(Pet {
            id: self.id,
            name: self.name,
            category_id: self.category_id,
            status,
        })
    }
}

fn row_to_raw(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawPet> {
    Ok(RawPet {
        id: row.get(0)?,
        name: row.get(1)?,
        category_id: row.get(2)?,
        status: row.get(3)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_pet(name: &str, status: PetStatus) -> NewPet {
        NewPet {
            name: name.into(),
            category_id: 1,
            status,
        }
    }

    #[tokio::test]
    async fn create_get_and_page_in_id_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = PetStore::open(&dir.path().join("nested/pets.db")).unwrap();
        let mut ids = Vec::new();
        for i in 0..5 {
            let status = if i % 2 == 0 {
                PetStatus::Available
            } else {
                PetStatus::Sold
            };
            ids.push(
                store
                    .create(new_pet(&format!("p{i}"), status))
                    .await
                    .unwrap()
                    .id,
            );
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(store.get(ids[3]).await.unwrap().unwrap().name, "p3");
        assert!(store.get(ids[4] + 1).await.unwrap().is_none());

        let page = store
            .list(ListQuery {
                limit: 2,
                status: None,
                after: 0,
            })
            .await
            .unwrap();
        assert_eq!(page.pets.iter().map(|p| p.id).collect::<Vec<_>>(), ids[..2]);
        assert!(page.has_more);
        let page = store
            .list(ListQuery {
                limit: 2,
                status: Some(PetStatus::Available),
                after: ids[0],
            })
            .await
            .unwrap();
        assert_eq!(
            page.pets.iter().map(|p| p.id).collect::<Vec<_>>(),
            [ids[2], ids[4]]
        );
        assert!(!page.has_more);
    }

    #[tokio::test]
    async fn reopening_keeps_pets_and_never_reuses_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pets.db");
        let first = PetStore::open(&path)
            .unwrap()
            .create(new_pet("a", PetStatus::Pending))
            .await
            .unwrap();
        let store = PetStore::open(&path).unwrap();
        assert_eq!(store.get(first.id).await.unwrap(), Some(first.clone()));
        let second = store
            .create(new_pet("b", PetStatus::Pending))
            .await
            .unwrap();
        assert!(second.id > first.id);
    }
}
