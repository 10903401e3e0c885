//! `mpirun -np N mt-launch bench-mpi`: the bandwidth of the collectives a multi-node step
//! makes, through the same shim, on buffers of the sizes a layer's gradient has. Prints,
//! for each size and collective, the time and the bus bandwidth (bytes each rank sends and
//! receives over a link: (N-1)/N of the buffer for a reduce-scatter or an all-gather, twice
//! that for an all-reduce), the figure comparable with a link's rate.

use std::time::Instant;

use anyhow::{Result, bail};

use crate::cli::BenchMpiArgs;

pub fn bench(args: BenchMpiArgs) -> Result<()> {
    let Some(m) = crate::mpi::init()? else {
        bail!("bench-mpi measures MPI collectives: run it under mpirun with 2 or more ranks");
    };
    if m.size < 2 {
        bail!("bench-mpi needs 2 or more ranks (mpirun -np 2 …)");
    }
    if m.rank == 0 {
        println!(
            "{} ranks (rank 0 on {}), f32 sums, {} repetitions after a warm-up; bus GB/s = (N-1)/N x bytes (x2 for all-reduce) / time",
            m.size, m.host, args.reps
        );
        println!(
            "{:>10} {:<26} {:>10} {:>10}",
            "MiB", "collective", "ms", "bus GB/s"
        );
    }
    let mut mib = 1usize;
    while mib <= args.max_mib {
        let n = (mib << 20) / 4 / m.size * m.size;
        let mut buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let mut part = vec![0f32; n / m.size];
        let share = (m.size - 1) as f64 / m.size as f64;
        let bytes = (n * 4) as f64;
        let row = |name: &str, links: f64, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
            f()?;
            m.barrier("bench barrier")?;
            let t = Instant::now();
            for _ in 0..args.reps {
                f()?;
            }
            m.barrier("bench barrier")?;
            let s = t.elapsed().as_secs_f64() / args.reps as f64;
            if m.rank == 0 {
                let bus = links * share * bytes / s / 1e9;
                println!("{mib:>10} {name:<26} {:>10.3} {bus:>10.2}", s * 1e3);
            }
            Ok(())
        };
        row("reduce-scatter", 1.0, &mut || {
            m.reduce_scatter("bench", &buf, &mut part)
        })?;
        row("all-reduce (RS + AG, ours)", 2.0, &mut || {
            m.allreduce_same("bench", &mut buf)
        })?;
        row("MPI_Allreduce", 2.0, &mut || {
            m.allreduce_mpi("bench", &mut buf)
        })?;
        mib *= 4;
    }
    Ok(())
}
