//! The key registry against a real `redis-server`: concurrent writers never lose a change, and
//! a re-run import never undoes a change made since.

use std::sync::Arc;
use std::time::Duration;

use e2e::RedisServer;
use proxy::keys::record::KeysError;
use proxy::keys::registry::Registry;
use proxy::keys::service::KeyStore;
use proxy::keys::{record, service};

fn plans(dir: &std::path::Path) -> proxy::keys::plans::Plans {
    std::fs::write(
        dir.join("free.toml"),
        "requests_per_minute = 60\nrequests_per_day = 1000\n",
    )
    .unwrap();
    proxy::keys::plans::Plans::load_dir(dir).unwrap()
}

/// A revocation that lands between another writer's read and write (here: a rotation of the
/// same key) is never overwritten: the rotation reads again, finds the key revoked, and fails.
#[test]
fn a_revocation_racing_a_rotation_is_never_undone() {
    let redis = RedisServer::start();
    let registry = Arc::new(Registry::new(&redis.url(), "test", Duration::from_secs(1)).unwrap());
    let store = KeyStore::Registry(Arc::clone(&registry));
    let dir = tempfile::tempdir().unwrap();
    let plans = plans(dir.path());
    let (record, _) = service::issue(
        &store,
        &plans,
        "free",
        None,
        "pet_test_",
        &Default::default(),
    )
    .unwrap();

    let mut first = true;
    let rotated = registry.modify(|file| {
        if std::mem::take(&mut first) {
            // Another writer revokes the key after this one read it.
            service::revoke(KeyStore::Registry(Arc::clone(&registry)), &record.id).unwrap();
        }
        let k = file.keys.iter_mut().find(|k| k.id == record.id).unwrap();
        if k.revoked_at.is_some() {
            return Err(KeysError::NotActive(k.id.clone()));
        }
        k.rotated_to = Some("key_successor".into());
        Ok(())
    });
    assert!(
        matches!(rotated, Err(KeysError::NotActive(_))),
        "{rotated:?}"
    );
    let (file, _) = registry.load().unwrap();
    let k = file.keys.iter().find(|k| k.id == record.id).unwrap();
    assert!(k.revoked_at.is_some(), "the revocation stands");
    assert!(k.rotated_to.is_none());
}

#[test]
fn a_second_import_adds_only_what_is_missing() {
    let redis = RedisServer::start();
    let registry = Arc::new(Registry::new(&redis.url(), "test", Duration::from_secs(1)).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let plans = plans(dir.path());
    let path = dir.path().join("keys.toml");
    let (a, _) = service::issue(
        &path,
        &plans,
        "free",
        None,
        "pet_test_",
        &Default::default(),
    )
    .unwrap();
    let file = record::KeysFile::load(&path).unwrap();
    assert_eq!(registry.import(&file.keys).unwrap(), (1, 0));
    service::revoke(KeyStore::Registry(Arc::clone(&registry)), &a.id).unwrap();
    service::issue(
        &path,
        &plans,
        "free",
        None,
        "pet_test_",
        &Default::default(),
    )
    .unwrap();
    let file = record::KeysFile::load(&path).unwrap();
    assert_eq!(registry.import(&file.keys).unwrap(), (1, 1));
    let (all, _) = registry.load().unwrap();
    assert_eq!(all.keys.len(), 2);
    let first = all.keys.iter().find(|k| k.id == a.id).unwrap();
    assert!(
        first.revoked_at.is_some(),
        "the import did not undo the revocation"
    );
}

/// The registry on a Redis Cluster: its two keys share a hash tag, so the compare-and-set
/// script runs on one node.
#[test]
fn the_registry_works_on_a_redis_cluster() {
    let cluster = e2e::RedisCluster::start(3, 0);
    let registry = Arc::new(Registry::new(&cluster.url(), "test", Duration::from_secs(2)).unwrap());
    let store = KeyStore::Registry(Arc::clone(&registry));
    let dir = tempfile::tempdir().unwrap();
    let plans = plans(dir.path());
    let (a, _) = service::issue(
        &store,
        &plans,
        "free",
        None,
        "pet_test_",
        &Default::default(),
    )
    .unwrap();
    service::issue(
        &store,
        &plans,
        "free",
        None,
        "pet_test_",
        &Default::default(),
    )
    .unwrap();
    service::revoke(store.clone(), &a.id).unwrap();
    let (file, position) = registry.load().unwrap();
    assert_eq!(file.keys.len(), 2);
    assert!(file
        .keys
        .iter()
        .any(|k| k.id == a.id && k.revoked_at.is_some()));
    assert_ne!(position, "0-0", "the change feed moved");
}
