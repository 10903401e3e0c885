//! The `nodes` section: how several nodes (`mpirun -np N mt-launch …`) share the host state.

use serde::{Deserialize, Serialize};

/// How several nodes share the host state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodesSection {
    /// Each node holds 1/N of the master weights and Adam moments and updates only its
    /// share, the updated store gathered into every node (true, the default); false: every
    /// node holds and updates all of it (the replicated state, 12/N more bytes per parameter
    /// less the exchange of the store). Both train the same bits.
    pub shard_state: bool,
}

impl Default for NodesSection {
    fn default() -> Self {
        NodesSection { shard_state: true }
    }
}
