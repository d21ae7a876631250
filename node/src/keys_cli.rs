//! `dynamoctl keys new`: a fresh API key and its key-file entry.

use dynamo_gateway::auth::{hash_key, parse_key_file};

/// A new random key (`dyn-` and 64 hex digits) and the `[[keys]]` entry
/// that admits it, checked as the gateway will read it.
pub fn new_key(
    name: &str,
    models: &[String],
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u64>,
) -> anyhow::Result<(String, String)> {
    use rand::Rng;
    anyhow::ensure!(
        dynamo_gateway::auth::valid_key_name(name),
        "--name {name:?}: a key's name is 1-64 characters of [A-Za-z0-9_.-]"
    );
    anyhow::ensure!(
        requests_per_minute != Some(0),
        "--requests-per-minute must be at least 1 (leave it out for no limit)"
    );
    anyhow::ensure!(
        tokens_per_minute != Some(0),
        "--tokens-per-minute must be at least 1 (leave it out for no limit)"
    );
    for m in models {
        anyhow::ensure!(
            !m.trim().is_empty() && m.len() <= 256 && !m.chars().any(char::is_control),
            "--model {m:?} is not a model name (empty, over 256 bytes, or with control characters)"
        );
    }
    let bytes: [u8; 32] = rand::rng().random();
    let key = format!("dyn-{}", hex::encode(bytes));
    let mut entry = format!(
        "[[keys]]\nname = {}\nsha256 = \"{}\"\n",
        toml_str(name),
        hex::encode(hash_key(&key))
    );
    if !models.is_empty() {
        let list: Vec<String> = models.iter().map(|m| toml_str(m)).collect();
        entry.push_str(&format!("models = [{}]\n", list.join(", ")));
    }
    if let Some(r) = requests_per_minute {
        entry.push_str(&format!("requests_per_minute = {r}\n"));
    }
    if let Some(t) = tokens_per_minute {
        entry.push_str(&format!("tokens_per_minute = {t}\n"));
    }
    parse_key_file(&entry).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((key, entry))
}

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_is_admitted_by_its_entry_and_bad_names_are_refused() {
        let (key, entry) = new_key("team-a", &["m".into()], Some(60), None).unwrap();
        let keys = parse_key_file(&entry).unwrap();
        assert_eq!(keys[0].sha256, hash_key(&key));
        assert_eq!(keys[0].models.as_deref(), Some(&["m".to_string()][..]));
        assert_eq!(keys[0].requests_per_minute, Some(60));
        let e = new_key("", &[], None, None).unwrap_err().to_string();
        assert!(e.starts_with("--name \"\": "), "{e}");
        assert!(new_key("two words", &[], None, None).is_err());
        let e = new_key("a", &[], Some(0), None).unwrap_err().to_string();
        assert!(e.starts_with("--requests-per-minute"), "{e}");
        for bad in ["", " ", "a\nb"] {
            assert!(new_key("a", &[bad.into()], None, None).is_err(), "{bad:?}");
        }
    }
}
