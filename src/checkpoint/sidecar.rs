//! A file of one tensor and string metadata beside a checkpoint's state: DPO's reference
//! log-probabilities ([`super::reference`]) and GRPO's old ones ([`super::old_logps`]). Both
//! read it the same way; what the tensor and metadata must be is theirs to check.

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

use crate::error::{Error, Result};

pub(super) struct Sidecar {
    path: PathBuf,
    bytes: Vec<u8>,
    meta: HashMap<String, String>,
}

impl Sidecar {
    /// Reads and parses `path`; where it does not exist, the error says `missing()`.
    pub fn read(path: PathBuf, missing: impl FnOnce() -> String) -> Result<Sidecar> {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Weights {
                    path,
                    msg: missing(),
                });
            }
            Err(e) => return Err(Error::io(&path, e)),
        };
        let mut file = Sidecar {
            path,
            bytes,
            meta: HashMap::new(),
        };
        let malformed = |e: safetensors::SafeTensorError| format!("not a safetensors file: {e}");
        let (_, meta) =
            SafeTensors::read_metadata(&file.bytes).map_err(|e| file.bad(malformed(e)))?;
        SafeTensors::deserialize(&file.bytes).map_err(|e| file.bad(malformed(e)))?;
        file.meta = meta.metadata().clone().unwrap_or_default();
        Ok(file)
    }

    /// An error about this file.
    pub fn bad(&self, msg: String) -> Error {
        Error::Weights {
            path: self.path.clone(),
            msg,
        }
    }

    /// The metadata's value for `key` ("" where it has none).
    pub fn meta(&self, key: &str) -> String {
        self.meta.get(key).cloned().unwrap_or_default()
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let st = SafeTensors::deserialize(&self.bytes).expect("parsed when read");
        st.tensor(name)
            .map_err(|_| self.bad(format!("no `{name}` tensor")))
    }
}
