//! The drives of `memory.optimizer_offload: nvme` ([`DrivePlan`]): the bytes the optimizer's
//! state takes on each (`crate::layout::drives`), against the space free there, so that
//! `mt-launch plan` and the launch refuse a run whose state does not fit, naming the
//! directory and its free space. `mt-launch plan --drive-size GB` sizes a machine that is not
//! this one: each directory then stands for a drive with that much room
//! ([`DrivePlan::with_drive_size`]), whether or not it exists here.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::config::{MasterWeights, OptimizerOffload, RunConfig};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::layout::drives::{Field, drive_bytes, field_sizes, update_bytes, window_bytes};

/// Disk bytes of the optimizer's state on the drives, and the host bytes streaming it.
#[derive(Debug, Clone, PartialEq)]
pub struct DrivePlan {
    /// `memory.nvme_path`: one directory per drive.
    pub dirs: Vec<PathBuf>,
    /// Bytes of the state on each of them (the master, m and v striped over them).
    pub per_drive: u64,
    /// Host bytes of the windows in flight (counted in the host plan).
    pub windows: u64,
    /// Room on each drive as the user stated it (`plan --drive-size`), instead of the free
    /// space read from the directories here.
    pub stated: Option<u64>,
    /// Bytes one update reads from the drives, and as many it writes back.
    pub update: u64,
    /// The fields on the drives and their bytes per parameter.
    pub fields: Vec<(Field, usize)>,
    /// Each drive's bandwidth, where known.
    pub speed: Option<DriveSpeed>,
    /// Bytes of the store kept beside the manifest in the first directory at the end of a
    /// run (`memory.keep_nvme_state` with a split or bf16 master, whose high halves or whole
    /// value the store holds: `megatrain-store.state`, 2 bytes a parameter); 0 otherwise.
    pub kept_store: u64,
}

/// The drives' bandwidth: measured in the directories here, or stated by the user.
#[derive(Debug, Clone, PartialEq)]
pub struct DriveSpeed {
    /// (read, write) bytes per second of each drive, in the order of the directories.
    pub per_drive: Vec<(f64, f64)>,
    pub source: SpeedSource,
}

/// Where a [`DriveSpeed`] comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpeedSource {
    /// `plan --drive-speed`.
    Stated,
    /// Written then read here, `bytes` in each directory, direct or (`direct` false)
    /// through the page cache.
    Measured { bytes: u64, direct: bool },
}

impl DrivePlan {
    /// The plan of `cfg`'s run over `layout` (None with the state in RAM).
    pub fn new(cfg: &RunConfig, layout: &Layout) -> Option<DrivePlan> {
        let m = &cfg.memory;
        if m.optimizer_offload != OptimizerOffload::Nvme {
            return None;
        }
        let n = m.nvme_path.len();
        Some(DrivePlan {
            dirs: m.nvme_path.clone(),
            per_drive: drive_bytes(layout, m.master_weights, m.moments_dtype, n),
            windows: window_bytes(layout, m.master_weights, m.moments_dtype),
            stated: None,
            update: update_bytes(layout, m.master_weights, m.moments_dtype),
            fields: field_sizes(m.master_weights, m.moments_dtype),
            speed: None,
            kept_store: match (m.keep_nvme_state, m.master_weights) {
                (true, MasterWeights::Split | MasterWeights::Bfloat16) => {
                    2 * layout.blocks.iter().map(|b| b.len as u64).sum::<u64>()
                }
                _ => 0,
            },
        })
    }

    /// The plan with the drives' bandwidth known.
    pub fn with_speed(self, speed: DriveSpeed) -> DrivePlan {
        DrivePlan {
            speed: Some(speed),
            ..self
        }
    }

    /// Seconds the drives take for one update's transfers: the update striped evenly over
    /// them, each drive reading its share and writing it back, its read and write times
    /// added (the update reads and writes at once, but one drive serves both), the slowest
    /// drive's. None where the speed is not known.
    pub fn update_s(&self) -> Option<f64> {
        let speed = self.speed.as_ref()?;
        let share = self.update as f64 / self.dirs.len() as f64;
        let each = speed.per_drive.iter().map(|&(r, w)| share / r + share / w);
        each.reduce(f64::max)
    }

    /// The plan with each directory standing for a drive of `bytes` of room: its check
    /// compares the share of one drive against it, reading nothing on this machine.
    pub fn with_drive_size(self, bytes: u64) -> DrivePlan {
        DrivePlan {
            stated: Some(bytes),
            ..self
        }
    }

    /// Bytes on all the drives, the kept store's included.
    pub fn total(&self) -> u64 {
        self.per_drive * self.dirs.len() as u64 + self.kept_store
    }

    /// Bytes the `i`-th directory's drive takes: its share, and the kept store on the first.
    fn on_drive(&self, i: usize) -> u64 {
        self.per_drive + if i == 0 { self.kept_store } else { 0 }
    }

    /// Refuses a directory that does not exist, and a filesystem without room for its
    /// drives' share (directories on one filesystem share its free space), naming it and
    /// its free space. A free space that cannot be read is not refused: the files are
    /// preallocated at start, which fails naming the file where they do not fit.
    pub fn check(&self) -> Result<()> {
        let gb = |b: u64| b as f64 / 1e9;
        let kept = match self.kept_store {
            0 => String::new(),
            b => format!(
                " (and {:.2} GB of the kept store on the first, memory.keep_nvme_state)",
                gb(b)
            ),
        };
        if let Some(room) = self.stated {
            return match self.on_drive(0) <= room {
                true => Ok(()),
                false => Err(Error::Config {
                    path: self.dirs[0].clone(),
                    msg: format!(
                        "memory.nvme_path: the optimizer state needs {:.2} GB on each of the {} \
                         drive(s){kept}, {:.2} GB stated (--drive-size)",
                        gb(self.per_drive),
                        self.dirs.len(),
                        gb(room)
                    ),
                }),
            };
        }
        // (device, first directory on it, directories on it, bytes on it)
        let mut filesystems: Vec<(u64, &PathBuf, u64, u64)> = Vec::new();
        for (i, d) in self.dirs.iter().enumerate() {
            let meta = std::fs::metadata(d).map_err(|e| Error::io(d, e))?;
            match filesystems.iter_mut().find(|f| f.0 == meta.dev()) {
                Some(f) => {
                    f.2 += 1;
                    f.3 += self.on_drive(i);
                }
                None => filesystems.push((meta.dev(), d, 1, self.on_drive(i))),
            }
        }
        for (_, dir, count, need) in filesystems {
            let Some(free) = crate::sysmem::free_disk_bytes(dir) else {
                continue;
            };
            if free < need {
                return Err(Error::Config {
                    path: dir.clone(),
                    msg: format!(
                        "memory.nvme_path: the optimizer state needs {:.2} GB on this filesystem \
                         ({count} of the {} drive director{} at {:.2} GB each{kept}), {:.2} GB free",
                        gb(need),
                        self.dirs.len(),
                        if self.dirs.len() == 1 { "y" } else { "ies" },
                        gb(self.per_drive),
                        gb(free)
                    ),
                });
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for DrivePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "drives (memory.optimizer_offload: nvme): {:.2} GB of master and Adam m, v, {:.2} GB on each of:",
            gb(self.per_drive * self.dirs.len() as u64),
            gb(self.per_drive)
        )?;
        for (i, d) in self.dirs.iter().enumerate() {
            let room = match self.stated {
                Some(room) => format!("{:.2} GB stated", gb(room)),
                None => crate::sysmem::free_disk_bytes(d)
                    .map_or("free space unknown".into(), |b| {
                        format!("{:.2} GB free", gb(b))
                    }),
            };
            let speed = self.speed.as_ref().map_or(String::new(), |s| {
                let (r, w) = s.per_drive[i];
                format!("; {:.2} GB/s read, {:.2} GB/s write", r / 1e9, w / 1e9)
            });
            writeln!(f, "  {} ({room}{speed})", d.display())?;
        }
        if self.kept_store > 0 {
            writeln!(
                f,
                "  and {:.2} GB of the store kept in the first at the run's end (memory.keep_nvme_state)",
                gb(self.kept_store)
            )?;
        }
        let parts: Vec<String> = (self.fields.iter())
            .map(|&(field, e)| match field {
                Field::Master if e == 2 => "master's low halves 2".to_string(),
                _ => format!("{} {e}", field.name()),
            })
            .collect();
        let time = match (&self.speed, self.update_s()) {
            (Some(s), Some(t)) => format!(
                "about {} s at the speeds {}, a drive's reads and writes taken in turn",
                seconds(t),
                match s.source {
                    SpeedSource::Stated => "stated by --drive-speed".to_string(),
                    SpeedSource::Measured { bytes, direct } => format!(
                        "measured here ({} MiB written then read in each directory{})",
                        bytes >> 20,
                        if direct {
                            ""
                        } else {
                            " through the page cache"
                        }
                    ),
                }
            ),
            _ => "pass --drive-speed GB/s for its time".into(),
        };
        writeln!(
            f,
            "each update reads {:.2} GB and writes {:.2} GB ({} B/param): {time}",
            gb(self.update),
            gb(self.update),
            parts.join(" + "),
        )
    }
}

/// `67.2`, `1.38`, `0.012`: three figures or one decimal.
fn seconds(t: f64) -> String {
    match t {
        t if t >= 10.0 => format!("{t:.1}"),
        t if t >= 1.0 => format!("{t:.2}"),
        t => format!("{t:.3}"),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A filesystem without room for its drives' share is refused, naming the directory and
    /// its free space; two directories on one filesystem need twice the share.
    #[test]
    fn a_drive_without_room_is_refused_naming_it() {
        let dir = std::env::temp_dir();
        let free = crate::sysmem::free_disk_bytes(&dir).expect("statvfs of the temp dir");
        let plan = |per_drive: u64, dirs: Vec<PathBuf>| DrivePlan {
            dirs,
            per_drive,
            windows: 0,
            stated: None,
            update: 0,
            fields: Vec::new(),
            speed: None,
            kept_store: 0,
        };
        plan(free / 4, vec![dir.clone()]).check().unwrap();
        let err = plan(free + (1 << 40), vec![dir.clone()])
            .check()
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.display().to_string()) && msg.contains("GB free"),
            "{msg}"
        );
        let sub = dir.join(format!("mt-drive-plan-{}", std::process::id()));
        std::fs::create_dir_all(&sub).unwrap();
        plan(free / 3, vec![dir.clone(), sub.clone()])
            .check()
            .unwrap();
        let err = plan(free / 2 + (1 << 30), vec![dir.clone(), sub.clone()]).check();
        assert!(err.is_err(), "two shares of one filesystem");
        let missing = plan(1, vec![Path::new("/nonexistent/nvme").into()]).check();
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("/nonexistent/nvme")
        );
        let _ = std::fs::remove_dir(&sub);
    }

    /// `memory.keep_nvme_state` with a split master keeps the bf16 store (2 bytes a
    /// parameter) beside the manifest in the first directory: the plan counts it there, and
    /// a first drive with room for its share but not for the store is refused, naming it.
    #[test]
    fn the_kept_store_takes_room_on_the_first_drive() {
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny/config.json");
        let hf: crate::config::hf::HfConfig =
            serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        let layout = Layout::new(&crate::config::hf::ModelSpec::from_hf(&hf, &config).unwrap());
        let params: u64 = layout.blocks.iter().map(|b| b.len as u64).sum();
        let yaml = "model: {path: m}\ndataset: {format: tokenized, path: d.jsonl}\n";
        let p = std::env::temp_dir().join(format!("mt-drives-{}.yaml", std::process::id()));
        std::fs::write(&p, yaml).unwrap();
        let base = RunConfig::load(&p, &[]).unwrap();
        let _ = std::fs::remove_file(&p);
        let plan = |keep: bool, master: MasterWeights| {
            let mut cfg = base.clone();
            cfg.memory.optimizer_offload = OptimizerOffload::Nvme;
            cfg.memory.nvme_path = vec!["/nonexistent/a".into(), "/nonexistent/b".into()];
            cfg.memory.keep_nvme_state = keep;
            cfg.memory.master_weights = master;
            DrivePlan::new(&cfg, &layout).unwrap()
        };
        assert_eq!(plan(false, MasterWeights::Split).kept_store, 0);
        let fp32 = plan(true, MasterWeights::Float32);
        assert_eq!(fp32.kept_store, 0, "an fp32 master keeps no store");
        let kept = plan(true, MasterWeights::Split);
        assert_eq!(kept.kept_store, 2 * params);
        assert_eq!(kept.total(), 2 * kept.per_drive + 2 * params);
        assert!(
            kept.to_string().contains("of the store kept in the first"),
            "{kept}"
        );
        let share = kept.per_drive;
        let room = |bytes| kept.clone().with_drive_size(bytes).check();
        room(share + 2 * params).unwrap();
        let msg = room(share + params).unwrap_err().to_string();
        assert!(msg.contains("of the kept store on the first"), "{msg}");
    }

    /// A stated drive size stands for the drive: directories that do not exist here plan,
    /// a share larger than the stated room is refused naming the first directory, the
    /// share and the room.
    #[test]
    fn a_stated_drive_size_replaces_the_free_space_here() {
        let dirs: Vec<PathBuf> = vec!["/nonexistent/nvme0".into(), "/nonexistent/nvme1".into()];
        let plan = DrivePlan {
            dirs,
            per_drive: 3_000_000_000,
            windows: 0,
            stated: None,
            update: 0,
            fields: Vec::new(),
            speed: None,
            kept_store: 0,
        };
        assert!(plan.clone().check().is_err(), "no such directory here");
        plan.clone().with_drive_size(3_000_000_000).check().unwrap();
        let msg = plan
            .clone()
            .with_drive_size(2_500_000_000)
            .check()
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("/nonexistent/nvme0")
                && msg.contains("3.00 GB on each of the 2")
                && msg.contains("2.50 GB stated"),
            "{msg}"
        );
        let shown = plan.with_drive_size(4_000_000_000).to_string();
        assert!(
            shown.contains("/nonexistent/nvme1 (4.00 GB stated)"),
            "{shown}"
        );
    }

    /// The update's drive time: each drive's even share read and written at its speeds,
    /// the times added, the slowest drive's; unknown without a speed.
    #[test]
    fn the_update_time_is_the_slowest_drives_share() {
        let plan = DrivePlan {
            dirs: vec!["/a".into(), "/b".into()],
            per_drive: 0,
            windows: 0,
            stated: None,
            update: 12_000_000_000,
            fields: vec![(Field::Master, 2), (Field::M, 2), (Field::V, 2)],
            speed: None,
            kept_store: 0,
        };
        assert_eq!(plan.update_s(), None);
        let plan = plan.with_speed(DriveSpeed {
            per_drive: vec![(2e9, 1e9), (3e9, 3e9)],
            source: SpeedSource::Stated,
        });
        // 6 GB each: 3 s + 6 s on the first, 2 s + 2 s on the second.
        assert_eq!(plan.update_s(), Some(9.0));
        let shown = plan.to_string();
        assert!(
            shown.contains("/a (free space unknown; 2.00 GB/s read, 1.00 GB/s write)"),
            "{shown}"
        );
        assert!(
            shown.contains(
                "each update reads 12.00 GB and writes 12.00 GB (master's low halves 2 + m 2 \
                 + v 2 B/param): about 9.00 s at the speeds stated by --drive-speed"
            ),
            "{shown}"
        );
    }
}
