//! The other nodes of a run, as the host state and the step exchange with them: the few
//! collectives a multi-node step makes, over pieces of a buffer ([`crate::layout::shards`]).
//! The launcher's MPI job implements them (`mt-launch`'s `mpi` module, which loads the MPI
//! shim); one node is [`Solo`], for which each is what it is on one rank: nothing to sum,
//! nothing to send. So the step has one path, whatever the number of nodes.
//!
//! Every rank passes the same `pieces` (contiguous, in rank order, covering the buffer, one
//! per rank) and makes the same calls in the same order; `what` names the collective in
//! the error a failed one gives.

use std::ops::Range;
use std::time::Duration;

use half::bf16;

use crate::Result;

/// A buffer a collective reads or writes, by element type (a split master's low halves
/// are `U16`: moved, never summed).
pub enum Elems<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    U16(&'a mut [u16]),
}

/// A buffer a collective only reads.
#[derive(Clone, Copy)]
pub enum ElemsRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    U16(&'a [u16]),
}

macro_rules! elems_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a mut [$t]> for Elems<'a> {
            fn from(x: &'a mut [$t]) -> Self {
                Elems::$v(x)
            }
        }
        impl<'a> From<&'a [$t]> for ElemsRef<'a> {
            fn from(x: &'a [$t]) -> Self {
                ElemsRef::$v(x)
            }
        }
    };
}
elems_from!(f32, F32);
elems_from!(bf16, Bf16);
elems_from!(u16, U16);

/// The collectives between the nodes of a run.
pub trait Peers: Sync {
    /// This node's rank, from 0.
    fn rank(&self) -> usize;

    /// Nodes of the run.
    fn size(&self) -> usize;

    /// Reduce-scatter by sum in place: `pieces[r]` of `buf` is summed over the ranks into
    /// this rank's piece (the others' pieces keep this rank's values).
    fn reduce_scatter_pieces(&self, what: &str, buf: Elems, pieces: &[Range<usize>]) -> Result<()>;

    /// All-gather in place: every rank's piece `pieces[r]` of `buf` goes to every rank.
    fn allgather_pieces(&self, what: &str, buf: Elems, pieces: &[Range<usize>]) -> Result<()>;

    /// Gathers every rank's piece (this rank's is `mine`) into `all` on rank 0, which must
    /// then cover the pieces; `all` is not used on other ranks.
    fn gather_pieces(
        &self,
        what: &str,
        mine: ElemsRef,
        all: Elems,
        pieces: &[Range<usize>],
    ) -> Result<()>;

    /// Every rank's `send` (all of one length), in rank order.
    fn allgather_f64(&self, what: &str, send: &[f64]) -> Result<Vec<f64>>;

    /// The largest of every rank's `value`.
    fn max_i64(&self, what: &str, value: i64) -> Result<i64>;

    /// The time spent so far waiting for the other ranks to reach a collective.
    fn waited(&self) -> Duration;
}

/// One node: rank 0 of 1.
pub struct Solo;

/// The one [`Solo`], for a `&'static dyn Peers`.
pub static SOLO: Solo = Solo;

impl Solo {
    /// Checks that `pieces` is the one piece of one rank, `0..len`.
    fn one_piece(len: usize, pieces: &[Range<usize>]) {
        let whole = pieces.len() == 1 && pieces[0] == (0..len);
        assert!(whole, "one node holds one piece, the whole buffer");
    }
}

impl Peers for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn reduce_scatter_pieces(&self, _: &str, buf: Elems, pieces: &[Range<usize>]) -> Result<()> {
        Solo::one_piece(buf.len(), pieces);
        Ok(())
    }

    fn allgather_pieces(&self, _: &str, buf: Elems, pieces: &[Range<usize>]) -> Result<()> {
        Solo::one_piece(buf.len(), pieces);
        Ok(())
    }

    fn gather_pieces(
        &self,
        _: &str,
        mine: ElemsRef,
        all: Elems,
        pieces: &[Range<usize>],
    ) -> Result<()> {
        Solo::one_piece(all.len(), pieces);
        match (mine, all) {
            (ElemsRef::F32(x), Elems::F32(a)) => a.copy_from_slice(x),
            (ElemsRef::Bf16(x), Elems::Bf16(a)) => a.copy_from_slice(x),
            (ElemsRef::U16(x), Elems::U16(a)) => a.copy_from_slice(x),
            _ => unreachable!("a gather receives its pieces' element type"),
        }
        Ok(())
    }

    fn allgather_f64(&self, _: &str, send: &[f64]) -> Result<Vec<f64>> {
        Ok(send.to_vec())
    }

    fn max_i64(&self, _: &str, value: i64) -> Result<i64> {
        Ok(value)
    }

    fn waited(&self) -> Duration {
        Duration::ZERO
    }
}

impl Elems<'_> {
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(x) => x.len(),
            Elems::Bf16(x) => x.len(),
            Elems::U16(x) => x.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
