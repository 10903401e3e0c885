//! Several nodes (`mt-launch plan --nodes N`): each node's host bytes per parameter and the
//! network traffic of a step.
//!
//! With the host state sharded across N nodes (issue #21, part 2: each node owns 1/N of
//! every block's master weights and Adam moments), a node holds the whole store, the whole
//! gradient accumulator, and 1/N of the master and moments: store + gradient + (master +
//! moments)/N bytes per parameter, 2 + 4 + 12/N with an fp32 master and fp32 gradient. The
//! step sends each block's gradient in a reduce-scatter and the updated store in an
//! all-gather.
//!
//! That is the default under mpirun (`nodes.shard_state: true`); with `false` every node
//! holds all of the state, as one node does, and the gradient is summed with a
//! reduce-scatter and an all-gather of the gradient.
//!
//! A checkpoint or the export of a sharded state is gathered on node 0 a window of a block
//! at a time ([`GATHER_WINDOW`] elements at most): node 0 holds that much of the master and
//! moments more, (master + moments) bytes per element ([`HostPlan::sharded`]'s `gather`).
//!
//! Traffic per node and step, each way over its link, with ring algorithms: a reduce-scatter
//! or an all-gather of B bytes moves (N-1)/N x B.

use super::{HostOpts, HostPlan, Staging};

/// The MPI shim's ring buffers on every node of a multi-node run (launcher/mpi/shim.c,
/// `ring_chunk`): two messages of 2^20 elements of up to 8 bytes.
pub const RING_BYTES: u64 = 2 * (1 << 20) * 8;
use crate::config::MasterWeights;
use crate::layout::Layout;
use crate::layout::shards::{GATHER_WINDOW, Shards};

impl HostPlan {
    /// The plan of node 0 of `nodes` (the largest): its shard of the master weights and
    /// moments (the most any node owns: pieces are rounded up to whole SIMD runs,
    /// [`crate::layout::shards`]), and its buffers to gather a window of a block of them
    /// for a checkpoint or the export: [`GATHER_WINDOW`] elements, or the largest block
    /// where that is shorter.
    ///
    /// Its default staging area is two windows ([`Staging::Windows`]): node 0 stages a
    /// background checkpoint window by window, so the one-node default of two whole blocks
    /// (30 GB for Qwen3.5-27B's embedding) would hold the memory sharding saves. It still
    /// grows into free RAM at launch ([`HostPlan::grow_staging`]). Like every node's, its
    /// plan holds the shim's ring buffers ([`HostPlan::on_nodes`]).
    pub fn sharded(self, layout: &Layout, nodes: usize) -> HostPlan {
        debug_assert!(!self.staging_grown, "sharded before the staging area grows");
        let elems = Shards::most(layout, nodes) as u64;
        let per_elem = self.master_bytes_per_elem() + 2 * self.opts.moments.size() as u64;
        let window = layout.max_block_len().min(GATHER_WINDOW);
        let staging = match self.opts.staging {
            Staging::Default { moments } => Staging::Windows { moments },
            other => other,
        };
        HostPlan {
            master: self.master_bytes_per_elem() * elems,
            adam: 2 * self.opts.moments.size() as u64 * elems,
            gather: per_elem * window as u64,
            staging: staging.bytes(layout),
            opts: HostOpts {
                staging,
                ..self.opts
            },
            ..self.on_nodes()
        }
    }

    /// The plan of a node of a multi-node run, sharded or not: it holds the MPI shim's
    /// ring buffers besides ([`RING_BYTES`]).
    pub fn on_nodes(self) -> HostPlan {
        HostPlan {
            exchange: RING_BYTES,
            ..self
        }
    }

    /// Bytes per element of the master beside the store (fp32, a split master's low
    /// halves, or none).
    fn master_bytes_per_elem(&self) -> u64 {
        match self.opts.master {
            MasterWeights::Float32 => 4,
            MasterWeights::Split => 2,
            MasterWeights::Bfloat16 => 0,
        }
    }
}

/// One node's share of an N-node run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodesPlan {
    pub nodes: u64,
    pub params: u64,
    /// Bytes per parameter on each node with the state replicated (`nodes.shard_state: false`).
    pub replicated_per_param: f64,
    /// Bytes per parameter on each node with the sharded state.
    pub sharded_per_param: f64,
    /// Bytes each node sends (and receives) per step, replicated: reduce-scatter and
    /// all-gather of the gradient.
    pub replicated_step_bytes: u64,
    /// The same with the sharded state: reduce-scatter of the gradient, all-gather of the
    /// store.
    pub sharded_step_bytes: u64,
    /// Node 0's host bytes with the sharded state, all told ([`HostPlan::sharded`]).
    pub sharded_node_bytes: u64,
    /// Of which node 0's buffers to gather a window of a block of the master and moments,
    /// and its staging area for background checkpoints (before it grows at launch).
    pub sharded_gather_bytes: u64,
    pub sharded_staging_bytes: u64,
}

/// Link rates the plan prints times for, GB/s (25 and 50 GB/s: 200 and 400 Gb/s).
pub const LINKS_GBPS: [f64; 2] = [25.0, 50.0];

impl NodesPlan {
    /// The plan of `nodes` nodes from one node's `host` plan and node 0's `sharded` one.
    pub fn new(host: &HostPlan, sharded: &HostPlan, nodes: u64) -> NodesPlan {
        assert!(nodes >= 1);
        let p = host.params as f64;
        let per = |b: u64| b as f64 / p;
        let share = (nodes - 1) as f64 / nodes as f64;
        let elems = host.grad / host.opts.grad.size() as u64;
        let (grad, store) = (
            host.opts.grad.size() as f64 * elems as f64,
            host.opts.store.size() as f64 * elems as f64,
        );
        NodesPlan {
            nodes,
            params: host.params,
            replicated_per_param: host.bytes_per_param(),
            sharded_per_param: per(host.store + host.grad)
                + per(host.master + host.adam) / nodes as f64,
            replicated_step_bytes: (share * 2.0 * grad) as u64,
            sharded_step_bytes: (share * (grad + store)) as u64,
            sharded_node_bytes: sharded.total(),
            sharded_gather_bytes: sharded.gather,
            sharded_staging_bytes: sharded.staging,
        }
    }

    /// Seconds `bytes` take on a link of `gbps` GB/s.
    pub fn seconds(bytes: u64, gbps: f64) -> f64 {
        bytes as f64 / (gbps * 1e9)
    }
}

impl std::fmt::Display for NodesPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(f, "on {} nodes, each node holds:", self.nodes)?;
        writeln!(
            f,
            "  {:.2} bytes per parameter with the state replicated (nodes.shard_state: false)",
            self.replicated_per_param
        )?;
        writeln!(
            f,
            "  {:.2} bytes per parameter with the state sharded (store + gradient + (master + moments)/{}; the default)",
            self.sharded_per_param, self.nodes
        )?;
        let staging = match self.sharded_staging_bytes {
            0 => String::new(),
            b => format!(
                " and {:.2} GB to stage background checkpoints (two windows, unless checkpoint.staging_size; grown into free RAM at launch)",
                gb(b)
            ),
        };
        writeln!(
            f,
            "  node 0 with the state sharded: {:.2} GB of host memory, of which {:.2} GB to gather a checkpoint a window at a time (up to 2^24 elements of a block's master and moments){staging}",
            gb(self.sharded_node_bytes),
            gb(self.sharded_gather_bytes)
        )?;
        for (name, bytes) in [
            ("replicated", self.replicated_step_bytes),
            ("sharded", self.sharded_step_bytes),
        ] {
            let times: Vec<String> = LINKS_GBPS
                .iter()
                .map(|&r| format!("{:.2} s at {r:.0} GB/s", Self::seconds(bytes, r)))
                .collect();
            writeln!(
                f,
                "  network per step ({name}): {:.2} GB each way per node: {}",
                gb(bytes),
                times.join(", ")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DType, MasterWeights};
    use crate::plan::{HostOpts, Staging};

    fn host(params: u64, grad: DType) -> HostPlan {
        let opts = HostOpts {
            store: DType::Bfloat16,
            grad,
            moments: DType::Float32,
            master: MasterWeights::Float32,
            workers: 1,
            slots: 4,
            staging: Staging::Off,
            offload: false,
        };
        HostPlan {
            params,
            tower_params: 0,
            opts,
            master: 4 * params,
            adam: 8 * params,
            grad: grad.size() as u64 * params,
            store: 2 * params,
            slabs: 0,
            staging: 0,
            staging_full: 0,
            staging_grown: false,
            carried: 0,
            vision: 0,
            gather: 0,
            exchange: 0,
            offloaded: 0,
            grpo_reference: 0,
            resident_transfer: 0,
            drive_windows: 0,
            slot_len: 0,
            workers: 1,
            slots: 4,
        }
    }

    /// The design's figure: store 2 + gradient 4 + 12/N bytes per parameter.
    #[test]
    fn sharded_bytes_per_param_are_store_grad_and_a_share_of_the_state() {
        let h = host(1_000_000_000, DType::Float32);
        let n = NodesPlan::new(&h, &h, 4);
        assert!((n.sharded_per_param - (2.0 + 4.0 + 12.0 / 4.0)).abs() < 1e-9);
        assert!((n.replicated_per_param - 18.0).abs() < 1e-9);
        // (N-1)/N of the gradient (4 B) and the store (2 B) per parameter.
        assert_eq!(n.sharded_step_bytes, 4_500_000_000);
        assert_eq!(n.replicated_step_bytes, 6_000_000_000);
        assert!((NodesPlan::seconds(n.sharded_step_bytes, 25.0) - 0.18).abs() < 1e-9);
    }

    #[test]
    fn one_node_sends_nothing() {
        let h = host(1000, DType::Bfloat16);
        let n = NodesPlan::new(&h, &h, 1);
        assert_eq!((n.sharded_step_bytes, n.replicated_step_bytes), (0, 0));
        assert!((n.sharded_per_param - n.replicated_per_param).abs() < 1e-9);
    }
}
