//! `pet-gateway registry keygen|sign`: the fleet's signing key for key records.

use crate::keys::signing::SigningKey;
use crate::ops::cli::RegistryCommand;

pub fn registry_command(cmd: RegistryCommand) -> Result<(), String> {
    match cmd {
        RegistryCommand::Keygen { out } => {
            let public = SigningKey::generate(&out).map_err(|e| e.to_string())?;
            eprintln!(
                "wrote the private key to {}; give every node this public key \
                 (registry_verify_keys):",
                out.display()
            );
            println!("{public}");
            Ok(())
        }
        RegistryCommand::Sign { files } => {
            let config = super::keys::key_config(&files, None)?;
            let Some(redis) = config.registry_redis() else {
                return Err(
                    "registry sign: the config's keys_source is not `store` (or it has \
                            no redis_url): there is no registry to sign"
                        .to_owned(),
                );
            };
            let registry = crate::ops::wiring::open_registry(
                &config,
                redis,
                std::time::Duration::from_secs(2),
                true,
            )?;
            let signed = registry.sign_all().map_err(|e| e.to_string())?;
            for r in &signed {
                println!(
                    "signed {} (plan {}, created {})",
                    r.id, r.plan, r.created_at
                );
            }
            println!(
                "{} record(s) signed; every record of the registry is signed now (bound to the \
                 environment where registry_signature_binding is sign or require)",
                signed.len()
            );
            Ok(())
        }
    }
}
