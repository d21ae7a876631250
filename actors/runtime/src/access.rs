//! How a process proves who it is to NATS, and how it checks the server.
//!
//! - [`BusAccess`]: what one connection uses: the CA that signed the NATS
//!   servers' certificates (TLS on), and the nkey seed of its user (one
//!   user per [`Role`] and namespace, whose subject permissions
//!   `dynamo_bus_schema::access` defines).
//! - [`Credentials`]: a directory of role seeds (`<role>.nk`, 0600), as
//!   `dynamoctl nats-auth` writes them and nodes read them; or seeds made in
//!   memory by a node that runs its own NATS server.
//!
//! Invariant: a seed never reaches a log (`Debug` prints the role only),
//! and seed files are written owner-only.

use crate::tls::{write_file, TlsError};
use dynamo_bus_schema::access::Role;
use dynamo_bus_schema::Namespace;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// PEM file of the CA that signed the NATS servers' certificates.
pub const ENV_NATS_CA: &str = "DYNAMO_NATS_CA";
/// Directory of role seeds (`<role>.nk`) for NATS users.
pub const ENV_NATS_CREDENTIALS: &str = "DYNAMO_NATS_CREDENTIALS";

#[derive(Debug, Error)]
pub enum AccessError {
    #[error("NATS credentials {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("NATS credentials {dir} hold no seed for the {role} role ({dir}/{role}.nk)")]
    MissingRole { dir: String, role: Role },
    #[error("cannot make an nkey: {0}")]
    Key(String),
    #[error(transparent)]
    Write(#[from] TlsError),
}

/// An nkey seed (a user's secret).
#[derive(Clone, PartialEq, Eq)]
pub struct Seed(String);

impl Seed {
    /// Parses a seed, checking it is a user's nkey seed.
    pub fn parse(text: &str) -> Result<Seed, String> {
        let s = text.trim();
        let kp = nkeys::KeyPair::from_seed(s).map_err(|e| e.to_string())?;
        if !kp.public_key().starts_with('U') {
            return Err("not a user nkey seed (SU...)".into());
        }
        Ok(Seed(s.to_string()))
    }

    /// A fresh user key.
    pub fn generate() -> Result<Seed, AccessError> {
        let kp = nkeys::KeyPair::new_user();
        kp.seed()
            .map(Seed)
            .map_err(|e| AccessError::Key(e.to_string()))
    }

    /// The public key the server's configuration names (`U...`).
    pub fn public_key(&self) -> String {
        nkeys::KeyPair::from_seed(&self.0)
            .map(|k| k.public_key())
            .unwrap_or_default()
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Seed({})", self.public_key())
    }
}

/// What one NATS connection presents.
#[derive(Clone, Debug, Default)]
pub struct BusAccess {
    /// PEM file of the CA that signed the servers' certificates. Set: TLS
    /// is required, and only servers that CA signed are trusted.
    pub ca_file: Option<PathBuf>,
    /// The user's seed and role (None: connect without a user).
    pub user: Option<(Role, Seed)>,
}

impl BusAccess {
    /// The same server checks, as `role` (when the credentials hold it).
    pub fn as_role(&self, creds: Option<&Credentials>, role: Role) -> Result<Self, AccessError> {
        Ok(BusAccess {
            ca_file: self.ca_file.clone(),
            user: match creds {
                None => None,
                Some(c) => Some((role, c.seed(role)?.clone())),
            },
        })
    }

    /// The role this connection is, if it has a user.
    pub fn role(&self) -> Option<Role> {
        self.user.as_ref().map(|(r, _)| *r)
    }

    /// Connection options: TLS with the CA, the nkey, and the inbox prefix
    /// the role's permissions allow (`_INBOX.<ns>.<role>`).
    pub(crate) fn apply(
        &self,
        mut opts: async_nats::ConnectOptions,
        ns: &Namespace,
    ) -> async_nats::ConnectOptions {
        if let Some(ca) = &self.ca_file {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((role, seed)) = &self.user {
            opts = opts
                .nkey(seed.expose().to_string())
                .custom_inbox_prefix(dynamo_bus_schema::access::inbox_prefix(*role, ns));
        }
        opts
    }
}

/// Seeds per role.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// Where they were read from (None: made in memory).
    pub dir: Option<PathBuf>,
    seeds: BTreeMap<Role, Seed>,
    /// Seed files read that other users may read (group or other bits set):
    /// each is warned about when read.
    pub exposed: Vec<PathBuf>,
}

impl Credentials {
    /// A fresh seed for every role.
    pub fn generate() -> Result<Credentials, AccessError> {
        let mut seeds = BTreeMap::new();
        for r in Role::ALL {
            seeds.insert(r, Seed::generate()?);
        }
        Ok(Credentials {
            dir: None,
            seeds,
            exposed: Vec::new(),
        })
    }

    /// Reads every `<role>.nk` in `dir` (at least one); other files are
    /// ignored.
    pub fn read(dir: &Path) -> Result<Credentials, AccessError> {
        use std::os::unix::fs::PermissionsExt;
        let mut seeds = BTreeMap::new();
        let mut exposed = Vec::new();
        for r in Role::ALL {
            let path = dir.join(format!("{r}.nk"));
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    let seed = Seed::parse(&text).map_err(|reason| AccessError::Read {
                        path: path.display().to_string(),
                        reason,
                    })?;
                    seeds.insert(r, seed);
                    // A warning, not a refusal: Kubernetes mounts a secret
                    // 0644 unless told otherwise.
                    let mode = std::fs::metadata(&path)
                        .map(|m| m.permissions().mode())
                        .unwrap_or(0);
                    if mode & 0o077 != 0 {
                        tracing::warn!(
                            path = %path.display(),
                            mode = format!("{:o}", mode & 0o777),
                            "a NATS seed file other users may read: it is a secret (chmod 600 it)"
                        );
                        exposed.push(path);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(AccessError::Read {
                        path: path.display().to_string(),
                        reason: e.to_string(),
                    })
                }
            }
        }
        if seeds.is_empty() {
            return Err(AccessError::Read {
                path: dir.display().to_string(),
                reason: format!(
                    "no <role>.nk seed file (roles: {})",
                    Role::ALL.map(|r| r.to_string()).join(", ")
                ),
            });
        }
        Ok(Credentials {
            dir: Some(dir.to_path_buf()),
            seeds,
            exposed,
        })
    }

    /// Only these roles' seeds (what one node or operator is handed).
    pub fn only(&self, roles: &[Role]) -> Credentials {
        Credentials {
            dir: self.dir.clone(),
            seeds: self
                .seeds
                .iter()
                .filter(|(r, _)| roles.contains(r))
                .map(|(r, s)| (*r, s.clone()))
                .collect(),
            exposed: self.exposed.clone(),
        }
    }

    /// The seed of a role.
    pub fn seed(&self, role: Role) -> Result<&Seed, AccessError> {
        self.seeds
            .get(&role)
            .ok_or_else(|| AccessError::MissingRole {
                dir: self
                    .dir
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_else(|| "(generated)".into()),
                role,
            })
    }

    /// The roles held, with their public keys.
    pub fn public_keys(&self) -> Vec<(Role, String)> {
        self.seeds
            .iter()
            .map(|(r, s)| (*r, s.public_key()))
            .collect()
    }

    /// Writes `<role>.nk` (0600) for every role held into `dir` (created
    /// 0700).
    pub fn write(&self, dir: &Path) -> Result<(), AccessError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| TlsError::Write {
                path: dir.display().to_string(),
                cause: source,
            })?;
        for (r, s) in &self.seeds {
            write_file(&dir.join(format!("{r}.nk")), s.expose(), true)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_round_trip_and_name_a_missing_role() {
        let dir = tempfile::tempdir().unwrap();
        let all = Credentials::generate().unwrap();
        all.only(&[Role::Worker, Role::Node])
            .write(dir.path())
            .unwrap();
        let back = Credentials::read(dir.path()).unwrap();
        assert_eq!(
            back.seed(Role::Worker).unwrap(),
            all.seed(Role::Worker).unwrap()
        );
        let e = back.seed(Role::Gateway).unwrap_err().to_string();
        assert!(e.contains("gateway.nk"), "{e}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("worker.nk"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(back.exposed.is_empty());
        // A seed file others may read is read, and named as exposed.
        std::fs::set_permissions(
            dir.path().join("node.nk"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let open = Credentials::read(dir.path()).unwrap();
        assert_eq!(open.exposed, vec![dir.path().join("node.nk")]);
        // A seed never prints.
        let shown = format!("{back:?}");
        assert!(!shown.contains(all.seed(Role::Worker).unwrap().expose()));
    }

    #[test]
    fn bad_seed_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("worker.nk"), "not a seed").unwrap();
        let e = Credentials::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("worker.nk"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = Credentials::read(empty.path()).unwrap_err().to_string();
        assert!(e.contains("no <role>.nk"), "{e}");
    }
}
