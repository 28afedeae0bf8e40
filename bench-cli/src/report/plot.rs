//! `collbench plot A.json B.json ... -o chart.svg`: bus bandwidth and time
//! per call against message size, one series per result file (collbench's
//! `--json`, or any file of the same shape, such as ci/compare.sh writes for
//! Open MPI and Gloo), labelled with what the file records: its `label`, else
//! library, transport and ranks. SVG, or PNG when the path ends in `.png`.
//! Text needs a TrueType font: DejaVu Sans where Debian puts it
//! (fonts-dejavu-core), or `COLL_PLOT_FONT`.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

/// One result file as a series.
struct Series {
    label: String,
    collective: String,
    /// (bytes, busbw GB/s, time us), out of place.
    points: Vec<(f64, f64, f64)>,
}

const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

pub fn run(files: &[PathBuf], out: &Path) -> Result<String, String> {
    if files.is_empty() {
        return Err("plot: name at least one result file (collbench --json)".into());
    }
    let series = files
        .iter()
        .map(|f| read(f))
        .collect::<Result<Vec<_>, _>>()?;
    register_font()?;
    let png = out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    let size = (1000, 900);
    let drawn = match png {
        true => draw(&BitMapBackend::new(out, size).into_drawing_area(), &series),
        false => draw(&SVGBackend::new(out, size).into_drawing_area(), &series),
    };
    drawn.map_err(|e| format!("plot: cannot draw {}: {e}", out.display()))?;
    Ok(format!(
        "wrote {} ({} series)\n",
        out.display(),
        series.len()
    ))
}

/// A collbench JSON document as a series.
fn read(path: &Path) -> Result<Series, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let rows = doc["rows"].as_array().ok_or_else(|| {
        format!(
            "{}: no \"rows\" (not collbench --json output)",
            path.display()
        )
    })?;
    let points: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter_map(|r| {
            let m = &r["out_of_place"];
            Some((
                r["bytes"].as_f64()?,
                m["busbw_gbs"].as_f64()?,
                m["time_us"].as_f64()?,
            ))
        })
        .filter(|p| p.0 > 0.0)
        .collect();
    if points.is_empty() {
        return Err(format!(
            "{}: no sizes above 0 bytes to plot",
            path.display()
        ));
    }
    let s = |k: &str| doc[k].as_str().unwrap_or("").to_string();
    let label = match doc["label"].as_str() {
        Some(l) => l.to_string(),
        None => format!("collectives, {}, {} ranks", s("transport"), doc["nranks"]),
    };
    Ok(Series {
        label,
        collective: s("collective"),
        points,
    })
}

fn register_font() -> Result<(), String> {
    let path = std::env::var("COLL_PLOT_FONT")
        .ok()
        .or_else(|| FONTS.iter().find(|f| Path::new(f).exists()).map(|f| f.to_string()))
        .ok_or("plot: no TrueType font for the labels: apt-get install fonts-dejavu-core, or set COLL_PLOT_FONT=/path/to/font.ttf")?;
    let bytes = std::fs::read(&path).map_err(|e| format!("plot: {path}: {e}"))?;
    // The font lives as long as the process (plotters keeps a reference).
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("plot: {path} is not a font plotters can read"))
}

type Fallible = Result<(), Box<dyn std::error::Error>>;

fn draw<B: DrawingBackend>(root: &DrawingArea<B, Shift>, series: &[Series]) -> Fallible
where
    B::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(450);
    let collectives: Vec<&str> = series.iter().map(|s| s.collective.as_str()).collect();
    let what = match collectives.windows(2).all(|w| w[0] == w[1]) {
        true => collectives[0].to_string(),
        false => "collectives".to_string(),
    };
    panel(
        &top,
        series,
        &format!("{what}: bus bandwidth"),
        "busbw (GB/s)",
        |p| p.1,
        false,
    )?;
    panel(
        &bottom,
        series,
        &format!("{what}: time per call"),
        "time (us)",
        |p| p.2,
        true,
    )?;
    root.present()?;
    Ok(())
}

/// One chart: `y` of each series against size (log scale), y on a log
/// scale or linear from zero.
fn panel<B: DrawingBackend>(
    area: &DrawingArea<B, Shift>,
    series: &[Series],
    caption: &str,
    y_desc: &str,
    y: impl Fn(&(f64, f64, f64)) -> f64,
    log_y: bool,
) -> Fallible
where
    B::ErrorType: 'static,
{
    // x is log2(bytes) on a linear axis: ticks land on powers of two.
    let xs = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0.log2()));
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(&y))
        .collect();
    let y_hi = ys.iter().cloned().fold(0f64, f64::max).max(1e-9) * 1.1;
    let y_lo = ys
        .iter()
        .cloned()
        .filter(|v| *v > 0.0)
        .fold(f64::MAX, f64::min)
        .min(y_hi)
        / 1.5;
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    let x_range = (x_lo - 0.5).floor()..(x_hi + 0.5).ceil();
    let bytes = |x: &f64| human(x.exp2());
    let number = |v: &f64| match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    };
    macro_rules! plot {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("message size")
                .y_desc(y_desc)
                .x_label_formatter(&bytes)
                .y_label_formatter(&number)
                .draw()?;
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let points: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0.log2(), y(p))).collect();
                chart
                    .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                    .label(s.label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    match log_y {
        true => plot!(builder.build_cartesian_2d(x_range, (y_lo..y_hi).log_scale())?),
        false => plot!(builder.build_cartesian_2d(x_range, 0f64..y_hi)?),
    }
    Ok(())
}

/// 8 B, 64 KiB, 16 MiB.
fn human(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut u) = (b, 0);
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    match v.fract() < 1e-9 {
        true => format!("{v:.0} {}", units[u]),
        false => format!("{v:.1} {}", units[u]),
    }
}
