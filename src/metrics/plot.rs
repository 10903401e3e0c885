//! A picture of a run from its metrics JSONL: an SVG with three panels over the optimizer
//! steps (training and eval loss, learning rate, tokens/s), written by hand (a few hundred
//! bytes of markup per series; no plotting dependency to build).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

const WIDTH: f64 = 760.0;
const PANEL: f64 = 210.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 18.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 34.0;
const HEADER: f64 = 28.0;

/// One line of a panel: (step, value) points, drawn with markers where points are sparse.
struct Series {
    name: &'static str,
    color: &'static str,
    points: Vec<(f64, f64)>,
    markers: bool,
}

/// Writes the picture of `metrics` (a metrics JSONL) beside it, `<stem>.svg`, and returns
/// its path.
pub fn write_beside(metrics: &Path) -> Result<PathBuf> {
    let out = metrics.with_extension("svg");
    write(metrics, &out)?;
    Ok(out)
}

/// Writes the picture of `metrics` to `out`.
pub fn write(metrics: &Path, out: &Path) -> Result<()> {
    let text = std::fs::read_to_string(metrics).map_err(|e| Error::io(metrics, e))?;
    let rows: Vec<Value> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::Config {
                path: metrics.into(),
                msg: format!("line {}: not a metrics JSON object: {e}", i + 1),
            })
        })
        .collect::<Result<_>>()?;
    let title = metrics
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let svg = svg(&title, &rows).ok_or_else(|| Error::Config {
        path: metrics.into(),
        msg: "no step with a `step` and a `loss`: nothing to plot".into(),
    })?;
    std::fs::write(out, svg).map_err(|e| Error::io(out, e))
}

/// The SVG of metrics rows; None when no row has a step and a loss.
pub fn svg(title: &str, rows: &[Value]) -> Option<String> {
    let col = |key: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|r| Some((r["step"].as_f64()?, r[key].as_f64()?)))
            .filter(|(_, v)| v.is_finite())
            .collect()
    };
    let loss = col("loss");
    if loss.is_empty() {
        return None;
    }
    let eval = col("eval_loss");
    let panels = [
        (
            "loss",
            vec![
                Series {
                    name: "train",
                    color: "#1f77b4",
                    points: loss,
                    markers: false,
                },
                Series {
                    name: "eval",
                    color: "#ff7f0e",
                    points: eval,
                    markers: true,
                },
            ],
        ),
        (
            "learning rate",
            vec![Series {
                name: "lr",
                color: "#2ca02c",
                points: col("lr"),
                markers: false,
            }],
        ),
        (
            "tokens/s",
            vec![Series {
                name: "tokens/s",
                color: "#9467bd",
                points: col("tokens_per_s"),
                markers: false,
            }],
        ),
    ];
    let steps = rows.iter().filter_map(|r| r["step"].as_f64());
    let last = steps.fold(1.0, f64::max);
    let height = HEADER + PANEL * panels.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"19\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
        escape(title)
    );
    for (i, (name, series)) in panels.iter().enumerate() {
        panel(&mut s, HEADER + PANEL * i as f64, name, series, last);
    }
    s += "</svg>\n";
    Some(s)
}

/// One panel at height `y0`: frame, grid and ticks, the series and their legend.
fn panel(s: &mut String, y0: f64, title: &str, series: &[Series], last_step: f64) {
    let values = series.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    let (lo, hi) = match (lo.is_finite(), lo < hi) {
        (false, _) => (0.0, 1.0),
        (true, true) => (lo, hi),
        (true, false) => (
            lo - lo.abs().max(1e-12) * 0.1,
            hi + hi.abs().max(1e-12) * 0.1,
        ),
    };
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (top, bottom) = (y0 + TOP, y0 + PANEL - BOTTOM);
    let (first, last) = (1.0f64.min(last_step), last_step.max(2.0));
    let x = |step: f64| x0 + (step - first) / (last - first) * (x1 - x0);
    let y = |v: f64| bottom - (v - lo) / (hi - lo) * (bottom - top);
    let _ = writeln!(
        s,
        "<text x=\"{x0}\" y=\"{}\" font-weight=\"bold\">{title}</text>",
        top - 8.0
    );
    for t in ticks(lo, hi) {
        let _ = writeln!(
            s,
            "<line x1=\"{x0}\" x2=\"{x1}\" y1=\"{0:.1}\" y2=\"{0:.1}\" stroke=\"#e4e4e4\"/>\
             <text x=\"{1}\" y=\"{2:.1}\" text-anchor=\"end\">{3}</text>",
            y(t),
            x0 - 6.0,
            y(t) + 4.0,
            label(t, hi - lo)
        );
    }
    for t in ticks(first, last).into_iter().filter(|t| t.fract() == 0.0) {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{t}</text>",
            x(t),
            bottom + 16.0
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{x0}\" y=\"{top}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\
         <text x=\"{x1}\" y=\"{}\" text-anchor=\"end\" fill=\"#555\">step</text>",
        x1 - x0,
        bottom - top,
        bottom + 30.0
    );
    let mut legend_x = x1;
    for l in series.iter().rev().filter(|l| !l.points.is_empty()) {
        let pts: Vec<String> = l
            .points
            .iter()
            .map(|&(st, v)| format!("{:.1},{:.1}", x(st), y(v)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" points=\"{}\"/>",
            l.color,
            pts.join(" ")
        );
        if l.markers || l.points.len() == 1 {
            for &(st, v) in &l.points {
                let _ = writeln!(
                    s,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\"/>",
                    x(st),
                    y(v),
                    l.color
                );
            }
        }
        if series.len() > 1 {
            legend_x -= 8.0 + 7.0 * l.name.len() as f64;
            let _ = writeln!(
                s,
                "<text x=\"{legend_x:.1}\" y=\"{}\" fill=\"{}\">&#9472; {}</text>",
                top - 8.0,
                l.color,
                l.name
            );
        }
    }
}

/// Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let raw = (hi - lo) / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 12 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

/// A tick label with the digits its axis `span` needs.
fn label(v: f64, span: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v.abs() < 1e-3 || v.abs() >= 1e6 {
        return format!("{v:.1e}");
    }
    let digits = (-(span / 4.0).log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{v:.digits$}")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 1.0), [0.0, 0.5, 1.0]);
        assert_eq!(ticks(1.37, 6.21), [2.0, 4.0, 6.0]);
        assert_eq!(ticks(0.0, 7.0), [0.0, 2.0, 4.0, 6.0]);
        assert_eq!(label(2e-5, 4e-5), "2.0e-5");
        assert_eq!(label(1500.0, 4000.0), "1500");
    }

    #[test]
    fn svg_has_every_series_and_skips_what_is_missing() {
        let rows: Vec<Value> = (1..=4)
            .map(|s| {
                let mut v = serde_json::json!({"step": s, "loss": 5.0 - s as f64, "lr": 1e-4, "tokens_per_s": 100.0 * s as f64});
                if s % 2 == 0 {
                    v["eval_loss"] = serde_json::json!(4.5 - s as f64);
                }
                v
            })
            .collect();
        let pic = svg("m.jsonl", &rows).unwrap();
        assert_eq!(
            pic.matches("<polyline").count(),
            4,
            "train, eval, lr, tokens/s"
        );
        assert_eq!(pic.matches("<circle").count(), 2, "eval points marked");
        assert!(pic.contains("learning rate") && pic.contains("tokens/s"));
        assert!(svg("t", &[serde_json::json!({"step": 1})]).is_none());
    }
}
