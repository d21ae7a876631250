//! `dynamoctl nats-auth`: NATS users for a cluster whose servers you run.
//!
//! For each namespace it makes one nkey user per role and writes:
//! - `<out>/auth.conf`: the nats-server `accounts` block (an account per
//!   namespace; public keys and each role's subject permissions) to
//!   `include` in every server's configuration;
//! - `<out>/<namespace>/<role>.nk`: the nodes' seeds (0600, directories
//!   0700), handed to nodes (`[nats] credentials`, `--nats-credentials`).
//!   Give each host only the roles it runs;
//! - `<out>/<namespace>.admin/admin.nk`: the operator's seed, apart, for
//!   `dynamoctl` (`$DYNAMO_NATS_CREDENTIALS`); never on a node;
//! - with `--tls-names`: `<out>/tls/{ca,cert,key}.pem`, a CA and a server
//!   certificate for those names, for the servers' `tls {}` block and the
//!   gateway's HTTPS (the CA's key is not kept: make a new set to add a
//!   server name).
//!
//! Nothing is overwritten: an existing `<out>/auth.conf` or seed
//! directory is an error, and nothing is written then.

use dynamo_bus_schema::access::{accounts, Role, User};
use dynamo_bus_schema::Namespace;
use dynamo_runtime::tls::Pki;
use dynamo_runtime::Credentials;
use std::path::Path;

/// A name the server certificate can hold: an IP address, or a DNS name
/// (labels of letters, digits and `-`, at most 63 each; a leading `*.`).
fn check_tls_name(n: &str) -> anyhow::Result<()> {
    let t = n.trim();
    if t.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    // A fully qualified name may end in a dot.
    let t = t.strip_suffix('.').unwrap_or(t);
    let host = t.strip_prefix("*.").unwrap_or(t);
    let ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    anyhow::ensure!(
        ok,
        "--tls-names {n:?} is not an IP address or a DNS name (nothing was written)"
    );
    Ok(())
}

/// Writes the users of `namespaces` (and TLS files for `tls_names`) into
/// `out`; returns what was written, one path a line.
pub fn write(out: &Path, namespaces: &[String], tls_names: &[String]) -> anyhow::Result<String> {
    if namespaces.is_empty() {
        anyhow::bail!("give at least one --namespace");
    }
    let auth_file = out.join("auth.conf");
    if auth_file.exists() {
        anyhow::bail!(
            "{} exists: choose another --out (nothing was written)",
            auth_file.display()
        );
    }
    for n in namespaces {
        for d in [out.join(n), out.join(format!("{n}.admin"))] {
            if d.exists() {
                anyhow::bail!(
                    "{} exists: choose another --out (nothing was written)",
                    d.display()
                );
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut users = Vec::new();
    let mut creds = Vec::new();
    for n in namespaces {
        let ns = Namespace::new(n).map_err(|e| anyhow::anyhow!("--namespace {n:?}: {e}"))?;
        if !seen.insert(n.clone()) {
            anyhow::bail!("--namespace {n:?} is given twice");
        }
        let c = Credentials::generate()?;
        for (role, nkey) in c.public_keys() {
            users.push(User {
                role,
                namespace: ns.clone(),
                nkey,
            });
        }
        creds.push((n.clone(), c));
    }
    for n in tls_names {
        check_tls_name(n)?;
    }
    let pki = if tls_names.is_empty() {
        None
    } else {
        let names: Vec<&str> = tls_names.iter().map(|n| n.trim()).collect();
        Some(Pki::generate("dynamo", &names)?)
    };
    let at = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| anyhow::anyhow!("cannot write {p}: {e}")
    };
    std::fs::create_dir_all(out).map_err(at(out))?;
    let mut written = Vec::new();
    for (n, c) in &creds {
        let dir = out.join(n);
        c.only(&crate::access::node_roles())
            .write(&dir)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", dir.display()))?;
        written.push(format!(
            "{}/ (the nodes' seeds, one <role>.nk per role)",
            dir.display()
        ));
        let admin = out.join(format!("{n}.admin"));
        c.only(&[Role::Admin])
            .write(&admin)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", admin.display()))?;
        written.push(format!(
            "{}/admin.nk (the operator's seed)",
            admin.display()
        ));
    }
    if let Some(pki) = pki {
        let dir = out.join("tls");
        std::fs::create_dir_all(&dir).map_err(at(&dir))?;
        let f = pki
            .write(&dir)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", dir.display()))?;
        written.push(format!(
            "{} {} {}",
            f.ca.display(),
            f.cert.display(),
            f.key.display()
        ));
    }
    dynamo_runtime::tls::write_file(&auth_file, &accounts(&users), false)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", auth_file.display()))?;
    written.push(auth_file.display().to_string());
    Ok(written.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_names_are_ip_addresses_or_dns_names() {
        for ok in [
            "127.0.0.1",
            "::1",
            "localhost",
            " localhost",
            "nats.example.com.",
            "nats-0.nats.svc",
            "*.example.com",
        ] {
            assert!(check_tls_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "bad name!", "*.*.x", "-a.b", "a..b", "*."] {
            assert!(check_tls_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn writes_users_seeds_and_certificates_and_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("auth");
        let names = ["127.0.0.1".to_string()];
        write(&out, &["t1".into(), "t2".into()], &names).unwrap();
        let conf = std::fs::read_to_string(out.join("auth.conf")).unwrap();
        assert_eq!(conf.matches("nkey:").count(), 14, "7 roles × 2 namespaces");
        let nodes = Credentials::read(&out.join("t1")).unwrap();
        let key = nodes.seed(Role::Worker).unwrap().public_key();
        assert!(conf.contains(&key));
        // The operator's seed is kept apart from the nodes'.
        assert!(nodes.seed(Role::Admin).is_err());
        let admin = Credentials::read(&out.join("t1.admin")).unwrap();
        assert!(conf.contains(&admin.seed(Role::Admin).unwrap().public_key()));
        assert!(conf.contains("\"dynamo_t1\": {") && conf.contains("\"dynamo_t2\": {"));
        assert!(out.join("tls/ca.pem").is_file());
        let again = write(&out, &["t1".into()], &[]).unwrap_err().to_string();
        assert!(again.contains("exists"), "{again}");
        // A run that stopped part-way (no auth.conf) is not overwritten either.
        std::fs::remove_file(out.join("auth.conf")).unwrap();
        let again = write(&out, &["t2".into()], &[]).unwrap_err().to_string();
        assert!(again.contains("t2") && again.contains("exists"), "{again}");
        let bad = write(&dir.path().join("x"), &["a.b".into()], &[])
            .unwrap_err()
            .to_string();
        assert!(bad.contains("--namespace"), "{bad}");
    }
}
