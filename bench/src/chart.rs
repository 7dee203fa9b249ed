//! One SVG chart per group: each figure's ratio to its same-run baseline (1.0 = as fast or
//! as cheap as the baseline), so groups with different units read the same way.

use crate::report::Group;
use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

/// DejaVu Sans from Debian's `fonts-dejavu-core` (installed by `cargo xtask bench`): the
/// SVG backend needs real glyph metrics to lay out labels.
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> Result<()> {
    static REGISTER: Once = Once::new();
    let mut outcome = Ok(());
    REGISTER.call_once(|| {
        outcome = std::fs::read(FONT)
            .with_context(|| format!("reading {FONT} (apt-get install fonts-dejavu-core)"))
            .and_then(|bytes| {
                // plotters keeps fonts for the process's lifetime; registering happens once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                register_font_bytes(bytes)
            });
    });
    outcome
}

fn register_font_bytes(bytes: &'static [u8]) -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{FONT} is not a usable font"))
}

/// Writes `group`'s ratio chart to `path`; does nothing when no figure has a baseline.
pub fn ratios(group: &Group, path: &Path) -> Result<()> {
    let bars: Vec<(String, f64)> = group
        .figures
        .iter()
        .filter_map(|f| Some((f.name.clone(), f.ratio()?)))
        .collect();
    if bars.is_empty() {
        return Ok(());
    }
    register_font()?;
    let height = 90 + 44 * bars.len() as u32;
    let root = SVGBackend::new(path, (760, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let top = bars.iter().map(|(_, r)| *r).fold(1.0f64, f64::max) * 1.15;
    let n = bars.len() as i32;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{} — ratio to same-run baseline", group.title),
            ("sans-serif", 17),
        )
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(260)
        .build_cartesian_2d(0f64..top, (0..n).into_segmented())
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(bars.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => bars
                .get(*i as usize)
                .map(|(name, r)| format!("{name} ({r:.2}×)"))
                .unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc("× baseline")
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
            let i = i as i32;
            Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (*r, SegmentValue::Exact(i + 1)),
                ],
                RGBColor(70, 110, 180).filled(),
            )
        }))
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(1.0, SegmentValue::Exact(0)), (1.0, SegmentValue::Exact(n))],
            RED.stroke_width(2),
        )))
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
