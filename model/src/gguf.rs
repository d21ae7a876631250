//! A reader for GGUF metadata (v2 and v3).
//!
//! The header, the key/value metadata and the tensor directory are read;
//! tensor data is never touched, so opening a model for its tokenizer costs
//! a few megabytes of I/O. [`GgufMetadata::data_offset`] says where the
//! tensor data starts for engines that load weights.
//! Every length read from the file is bounded before allocating, so a corrupt
//! or hostile file yields a [`GgufError`], never a panic or an OOM.

use std::collections::BTreeMap;
use std::io::{BufReader, Read};
use std::path::Path;
use thiserror::Error;

const MAX_STRING: u64 = 64 * 1024 * 1024;
const MAX_ARRAY: u64 = 16 * 1024 * 1024;
const MAX_KEYS: u64 = 1 << 16;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_DIMS: u32 = 8;

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("cannot read {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("{path} is not a GGUF file (magic {magic:?})")]
    BadMagic { path: String, magic: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are)")]
    UnsupportedVersion { path: String, version: u32 },
    #[error("{path}: metadata key {key:?}: {reason}")]
    BadValue {
        path: String,
        key: String,
        reason: String,
    },
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    /// ggml type id (0 = F32, 1 = F16, 3 = Q4_1, 8 = Q8_0, ...).
    pub ggml_type: u32,
    /// Offset from [`GgufMetadata::data_offset`].
    pub offset: u64,
}

/// The metadata of one GGUF file.
#[derive(Clone, Debug)]
pub struct GgufMetadata {
    pub version: u32,
    pub tensor_count: u64,
    pub kv: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
}

impl GgufMetadata {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.get(key)
    }
    /// Reads the metadata of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let p = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| GgufError::Io {
            path: p.clone(),
            cause: source,
        })?;
        Self::read(&mut BufReader::with_capacity(1 << 20, file), &p)
    }

    /// Reads metadata from any reader (`name` is used in errors).
    pub fn read(r: &mut impl Read, name: &str) -> Result<Self, GgufError> {
        let mut rd = Reader {
            r,
            path: name,
            key: String::new(),
            pos: 0,
        };
        let magic = rd.bytes4()?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic {
                path: name.into(),
                magic,
            });
        }
        let version = rd.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion {
                path: name.into(),
                version,
            });
        }
        let tensor_count = rd.u64()?;
        let kv_count = rd.u64()?;
        if kv_count > MAX_KEYS {
            return Err(rd.bad(format!("{kv_count} metadata keys is implausible")));
        }
        let mut kv = BTreeMap::new();
        for _ in 0..kv_count {
            rd.key.clear();
            let key = rd.string()?;
            rd.key = key.clone();
            let ty = rd.u32()?;
            let value = rd.value(ty, 0)?;
            kv.insert(key, value);
        }
        if tensor_count > MAX_TENSORS {
            return Err(rd.bad(format!("{tensor_count} tensors is implausible")));
        }
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            rd.key = "tensor directory".into();
            let name = rd.string()?;
            let n_dims = rd.u32()?;
            if n_dims > MAX_DIMS {
                return Err(rd.bad(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| rd.u64()).collect::<Result<_, _>>()?;
            let ggml_type = rd.u32()?;
            let offset = rd.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = kv
            .get("general.alignment")
            .and_then(Value::as_u64)
            .filter(|a| *a > 0)
            .unwrap_or(32);
        let data_offset = rd.pos.div_ceil(align) * align;
        Ok(GgufMetadata {
            version,
            tensor_count,
            kv,
            tensors,
            data_offset,
        })
    }
}

struct Reader<'a, R: Read> {
    r: &'a mut R,
    path: &'a str,
    key: String,
    /// Bytes consumed so far.
    pos: u64,
}

impl<R: Read> Reader<'_, R> {
    fn bad(&self, reason: String) -> GgufError {
        GgufError::BadValue {
            path: self.path.into(),
            key: self.key.clone(),
            reason,
        }
    }
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), GgufError> {
        self.r.read_exact(buf).map_err(|source| GgufError::Io {
            path: self.path.into(),
            cause: source,
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }
    fn bytes4(&mut self) -> Result<[u8; 4], GgufError> {
        let mut b = [0u8; 4];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes4()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.bad(format!("string of {len} bytes is implausible")));
        }
        let mut buf = vec![0u8; len as usize];
        self.fill(&mut buf)?;
        String::from_utf8(buf).map_err(|e| self.bad(format!("string is not UTF-8: {e}")))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        let mut b8 = [0u8; 8];
        Ok(match ty {
            0 => {
                self.fill(&mut b8[..1])?;
                Value::U64(b8[0] as u64)
            }
            1 => {
                self.fill(&mut b8[..1])?;
                Value::I64(b8[0] as i8 as i64)
            }
            2 => {
                self.fill(&mut b8[..2])?;
                Value::U64(u16::from_le_bytes([b8[0], b8[1]]) as u64)
            }
            3 => {
                self.fill(&mut b8[..2])?;
                Value::I64(i16::from_le_bytes([b8[0], b8[1]]) as i64)
            }
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_le_bytes(self.bytes4()?) as f64),
            7 => {
                self.fill(&mut b8[..1])?;
                Value::Bool(b8[0] != 0)
            }
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.bad("arrays nested too deeply".into()));
                }
                let elem = self.u32()?;
                let len = self.u64()?;
                if len > MAX_ARRAY {
                    return Err(self.bad(format!("array of {len} elements is implausible")));
                }
                let mut out = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    out.push(self.value(elem, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(self.bad(format!("unknown value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v.as_bytes());
    }

    #[test]
    fn reads_a_small_file_and_rejects_garbage() {
        let mut f = b"GGUF".to_vec();
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&1u64.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes());
        s(&mut f, "a.len");
        f.extend_from_slice(&4u32.to_le_bytes());
        f.extend_from_slice(&7u32.to_le_bytes());
        s(&mut f, "a.list");
        f.extend_from_slice(&9u32.to_le_bytes());
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes());
        s(&mut f, "x");
        s(&mut f, "yz");
        s(&mut f, "w");
        f.extend_from_slice(&2u32.to_le_bytes());
        f.extend_from_slice(&32u64.to_le_bytes());
        f.extend_from_slice(&4u64.to_le_bytes());
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&0u64.to_le_bytes());
        let m = GgufMetadata::read(&mut f.as_slice(), "t").unwrap();
        assert_eq!(
            m.tensors,
            vec![TensorInfo {
                name: "w".into(),
                dims: vec![32, 4],
                ggml_type: 3,
                offset: 0
            }]
        );
        assert_eq!(m.data_offset, (f.len() as u64).div_ceil(32) * 32);
        assert_eq!(m.get("a.len").and_then(Value::as_u64), Some(7));
        assert_eq!(
            m.get("a.list").and_then(Value::as_array).map(|a| a.len()),
            Some(2)
        );
        // Truncated anywhere → error, not panic.
        for cut in 0..f.len() {
            assert!(GgufMetadata::read(&mut &f[..cut], "t").is_err());
        }
        // A huge declared length → error, not an allocation.
        let mut huge = f[..24].to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(GgufMetadata::read(&mut huge.as_slice(), "t").is_err());
    }
}
