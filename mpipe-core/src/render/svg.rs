//! The pipeline Gantt chart as a standalone SVG document.
//!
//! [`gantt_svg`] draws the figure pipeline-parallelism papers draw: one row per
//! rank (rank 0 on top, labelled `rank 0`, `rank 1`...), time on the x axis with a
//! tick axis, and one box per compute action from its start to its end (a run of
//! layer tasks of a program cut by `layers` drawn as one box, see `runs`),
//! coloured by kind:
//!
//! | kind | LLM family | encoder |
//! | --- | --- | --- |
//! | `F` | blue | orange |
//! | `B` (input gradient) | green | brown |
//! | `W` (weight gradient) | purple | tan |
//! | `BW` (fused) | red | dark brown |
//! | `RF` (recompute) | light blue, hatched | light orange, hatched |
//!
//! (encoders and chunks as defined in [`crate::render`]). When several `llm.K`
//! chunks share a rank, chunk 0 is drawn slightly darker and later chunks
//! progressively lighter, so interleaved and V schedules read at a glance. The
//! micro-batch number is written inside a box when it fits, in one font size for
//! the whole chart: the largest (up to about half the row height) at which at
//! least half of the boxes hold their label; boxes too narrow for it stay
//! unlabelled, and when that size would be under 7 px there are no labels.
//!
//! With `opts.memory`, each row also holds its rank's activation memory over the
//! step as a step line ([`memory_over_time`]), the highest peak over the ranks at
//! the row's full height, its peak in the line's title; the legend says the scale.
//!
//! Idle time is the light-grey row background left blank. A transfer or
//! collective that waited (its slot has `end > start`) is drawn as a thin
//! grey-hatched bar across the middle of the row; transfers that did not wait are
//! not drawn. Every box and bar has a `<title>` child (the action, its rank and its
//! times), which browsers show on hover. Below the rows: the time axis, a legend
//! of the kinds that occur, and a footer line: `opts.subtitle` when given, else
//! the makespan, the bubble ratio (`1 - compute / (ranks * makespan)`, compute
//! being the summed length of the drawn compute slots), and the problem size.
//!
//! Output promises: a well-formed XML document (every text escaped), UTF-8,
//! byte-identical for identical inputs, coordinates with at most 2 decimals and
//! times with at most 3. Compute boxes carry `class="op KIND"` (`KIND` one of
//! `F B W BW RF`, plus `enc` for encoders) and wait bars `class="wait"`, so a
//! stylesheet or a test can find them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use super::look::{fmt_num, placed, unit_looks, UnitLook};
use crate::ir::program::{Action, ActionRef, Op, Program, Role, Tensor};
use crate::judge::simulate::memory_over_time;
use crate::judge::timeline::{Slot, Timeline};

/// Layout and text of a Gantt chart.
#[derive(Clone, Debug, PartialEq)]
pub struct SvgOptions {
    /// Width of the whole picture in pixels (default 1400; at least 300 is used).
    pub width: f64,
    /// Height of one rank's row in pixels (default 28; clamped to 8..=200).
    pub row_height: f64,
    /// Title drawn above the chart.
    pub title: Option<String>,
    /// Footer line; when `None`, makespan, bubble ratio and problem size.
    pub subtitle: Option<String>,
    /// Draw each rank's activation memory over the step as a line in its row,
    /// the largest peak over the ranks at the row's full height (default false).
    pub memory: bool,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            width: 1400.0,
            row_height: 28.0,
            title: None,
            subtitle: None,
            memory: false,
        }
    }
}

/// What a compute box is, for its colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Kind {
    encoder: bool,
    op: Op,
}

impl Kind {
    /// Base colour (chunk 0 of 1), as 0xRRGGBB.
    fn base(self) -> u32 {
        match (self.encoder, self.op) {
            (false, Op::F) => 0x3b75af,
            (false, Op::B) => 0x2e9e5b,
            (false, Op::W) => 0x8e6cc0,
            (false, Op::BW) => 0xc44e52,
            (false, Op::RF) => 0x3b75af,
            (true, Op::F) => 0xf08c2e,
            (true, Op::B) => 0x8c564b,
            (true, Op::W) => 0xc8a470,
            (true, Op::BW) => 0x5c3a21,
            (true, Op::RF) => 0xf08c2e,
        }
    }

    fn label(self) -> &'static str {
        match (self.encoder, self.op) {
            (false, Op::F) => "F forward",
            (false, Op::B) => "B input grad",
            (false, Op::W) => "W weight grad",
            (false, Op::BW) => "BW fused backward",
            (false, Op::RF) => "RF recompute",
            (true, Op::F) => "encoder F",
            (true, Op::B) => "encoder B",
            (true, Op::W) => "encoder W",
            (true, Op::BW) => "encoder BW",
            (true, Op::RF) => "encoder RF",
        }
    }
}

/// How a box is filled: a plain colour, or the hatch of a recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fill {
    Solid(u32),
    /// (background, line colour)
    Hatch(u32, u32),
}

impl Fill {
    fn attr(self) -> String {
        match self {
            Fill::Solid(c) => hex(c),
            Fill::Hatch(bg, fg) => format!("url(#mpipe-rf-{bg:06x}-{fg:06x})"),
        }
    }

    /// The colour text sits on.
    fn background(self) -> u32 {
        match self {
            Fill::Solid(c) | Fill::Hatch(c, _) => c,
        }
    }
}

/// The fill of a box of kind `k` on a unit that looks like `look`.
fn fill(k: Kind, look: UnitLook) -> Fill {
    let mut c = k.base();
    if look.chunks > 1 {
        // Chunk 0 a little darker, the last chunk much lighter.
        let t = look.chunk as f64 / (look.chunks - 1) as f64;
        let f = -0.15 + 0.6 * t;
        c = if f < 0.0 {
            mix(c, 0x000000, -f)
        } else {
            mix(c, 0xffffff, f)
        };
    }
    if k.op == Op::RF {
        Fill::Hatch(mix(c, 0xffffff, 0.6), mix(c, 0xffffff, 0.15))
    } else {
        Fill::Solid(c)
    }
}

fn hex(c: u32) -> String {
    format!("#{c:06x}")
}

/// `a` moved a fraction `t` of the way towards `b`, per channel.
fn mix(a: u32, b: u32, t: f64) -> u32 {
    let ch = |c: u32, s: u32| ((c >> s) & 0xff) as f64;
    let mut out = 0;
    for s in [16, 8, 0] {
        let v = ch(a, s) + (ch(b, s) - ch(a, s)) * t;
        out |= (v.round().clamp(0.0, 255.0) as u32) << s;
    }
    out
}

/// Relative luminance in 0..=1 (sRGB weights, no gamma: good enough for contrast).
fn luminance(c: u32) -> f64 {
    let ch = |s: u32| ((c >> s) & 0xff) as f64 / 255.0;
    0.299 * ch(16) + 0.587 * ch(8) + 0.114 * ch(0)
}

/// `s` with the five XML special characters escaped.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A pixel coordinate.
fn px(x: f64) -> String {
    fmt_num(x, 2)
}

/// A time.
fn tm(x: f64) -> String {
    fmt_num(x, 3)
}

/// Rough width of `text` at `size` px in a sans-serif font.
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.56
}

/// A round tick step giving about `target` ticks over `span`.
fn tick_step(span: f64, target: f64) -> f64 {
    let raw = span / target.max(1.0);
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let m = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// Smallest legible label font size, in pixels.
const MIN_LABEL: f64 = 7.0;

/// Drawn width of a box spanning `w` pixels: a sliver of background between
/// neighbours keeps them apart.
fn box_width(w: f64) -> f64 {
    let sep = if w > 3.0 { (w * 0.12).min(1.0) } else { 0.0 };
    (w - sep).max(0.6)
}

/// Largest font size at which `digits` digits fit in a box `w` pixels wide.
fn label_size_for(w: f64, digits: usize) -> f64 {
    (w - 3.0).max(0.0) / (digits.max(1) as f64 * 0.6)
}

/// One legend entry: its swatch fills (drawn side by side) and its text.
struct LegendItem {
    /// Swatches; none: the waiting hatch.
    fills: Vec<Fill>,
    text: String,
    /// A line swatch (the memory line) instead.
    line: bool,
}

/// One drawn box: an action with its slot, or a run of layer tasks drawn as one
/// (`last` the run's last unit, `slot` from its first start to its last end).
struct Drawn<'a> {
    rank: usize,
    action: &'a Action,
    slot: Slot,
    last: Option<&'a str>,
}

/// The model part each layer unit of `p` (cut by `layers`) belongs to, by its role:
/// `llm` for the LLM's layers, the encoder's name for an encoder's.
fn layer_parts(p: &Program) -> BTreeMap<&str, &str> {
    p.units
        .iter()
        .filter_map(|u| match &u.role {
            Role::StageLayer => Some((u.name.as_str(), "llm")),
            Role::EncoderLayer(of) => Some((u.name.as_str(), of.as_str())),
            _ => None,
        })
        .collect()
}

/// Every placed action as drawn: consecutive compute actions of one rank with the
/// same kind and micro-batch, on layer units of the same model part, each starting
/// when the one before ends (transfers between them that did not wait are not
/// drawn), as one box.
fn runs<'a>(p: &'a Program, t: &'a Timeline) -> Vec<Drawn<'a>> {
    let mut out: Vec<Drawn<'a>> = Vec::new();
    let parts = layer_parts(p);
    let layer_part = |unit: &str| parts.get(unit).copied();
    // Index in `out` of the run that the next compute action may extend.
    let mut open: Option<usize> = None;
    for (r, a, s) in placed(p, t) {
        let next = match a.view() {
            ActionRef::Compute(c) => c,
            _ => {
                if s.end > s.start || out.last().is_some_and(|d| d.rank != r) {
                    open = None;
                }
                out.push(Drawn {
                    rank: r,
                    action: a,
                    slot: s,
                    last: None,
                });
                continue;
            }
        };
        if let Some(i) = open {
            let d = &out[i];
            if let ActionRef::Compute(c) = d.action.view() {
                let joins = d.rank == r
                    && c.op == next.op
                    && c.mb == next.mb
                    && layer_part(c.unit).is_some()
                    && layer_part(c.unit) == layer_part(next.unit)
                    && d.slot.end == s.start;
                if joins {
                    let d = &mut out[i];
                    d.slot.end = s.end;
                    d.last = Some(next.unit);
                    continue;
                }
            }
        }
        open = Some(out.len());
        out.push(Drawn {
            rank: r,
            action: a,
            slot: s,
            last: None,
        });
    }
    out
}

/// Render the Gantt chart of program `p` executed as timeline `t` (see the module
/// documentation for what it shows and promises).
pub fn gantt_svg(p: &Program, t: &Timeline, opts: &SvgOptions) -> String {
    let width = if opts.width.is_finite() {
        opts.width.max(300.0)
    } else {
        1400.0
    };
    let row_h = if opts.row_height.is_finite() {
        opts.row_height.clamp(8.0, 200.0)
    } else {
        28.0
    };
    let looks = unit_looks(p);
    let look_of = |u: &str| looks.get(u).copied().unwrap_or(UnitLook::UNKNOWN);
    let nrows = p.ranks.max(p.programs.len());

    let makespan = placed(p, t)
        .map(|(_, _, s)| s.end)
        .filter(|e| e.is_finite())
        .fold(0.0, f64::max);
    let span = if makespan > 0.0 { makespan } else { 1.0 };

    // Layout.
    let left = 72.0;
    let right = 28.0;
    let plot_w = width - left - right;
    let scale = plot_w / span;
    let top = if opts.title.is_some() { 44.0 } else { 16.0 };
    let gap = (row_h * 0.22).round().max(2.0);
    let pitch = row_h + gap;
    let rows_bottom = top + nrows as f64 * pitch - gap;
    let axis_y = rows_bottom + 4.0;
    let x_of = |time: f64| left + time.clamp(0.0, span) * scale;
    let y_of = |r: usize| top + r as f64 * pitch;

    // What occurs, for the legend and the pattern definitions.
    let mut kinds: BTreeSet<Kind> = BTreeSet::new();
    let mut hatches: BTreeSet<(u32, u32)> = BTreeSet::new();
    let mut max_chunks = 1;
    let mut waited = false;
    let mut compute_time = 0.0;
    for (_, a, s) in placed(p, t) {
        match a.view() {
            ActionRef::Compute(c) => {
                let look = look_of(c.unit);
                let kind = Kind {
                    encoder: look.encoder,
                    op: c.op,
                };
                kinds.insert(kind);
                if let Fill::Hatch(bg, fg) = fill(kind, look) {
                    hatches.insert((bg, fg));
                }
                max_chunks = max_chunks.max(look.chunks);
                if (s.end - s.start).is_finite() {
                    compute_time += (s.end - s.start).max(0.0);
                }
            }
            ActionRef::P2p(_) | ActionRef::Coll(_) => waited |= s.end > s.start,
        }
    }

    // Legend entries, laid out left to right, wrapping.
    let mut legend: Vec<LegendItem> = kinds
        .iter()
        .map(|&k| LegendItem {
            fills: vec![fill(k, UnitLook::UNKNOWN)],
            text: k.label().to_string(),
            line: false,
        })
        .collect();
    if max_chunks > 1 {
        for c in 0..max_chunks {
            let look = UnitLook {
                encoder: false,
                chunk: c,
                chunks: max_chunks,
            };
            let fills = [Op::F, Op::B, Op::W]
                .iter()
                .map(|&op| fill(Kind { encoder: false, op }, look))
                .collect();
            legend.push(LegendItem {
                fills,
                text: format!("chunk {c}"),
                line: false,
            });
        }
    }
    if waited {
        legend.push(LegendItem {
            fills: vec![],
            text: "waiting in a transfer".to_string(),
            line: false,
        });
    }
    // Memory lines: each rank's steps, scaled so the highest peak fills a row.
    let memory: Vec<Vec<(f64, f64)>> = if opts.memory {
        memory_over_time(p, t).unwrap_or_default()
    } else {
        Vec::new()
    };
    let highest = memory
        .iter()
        .flatten()
        .map(|&(_, level)| level)
        .filter(|l| l.is_finite())
        .fold(0.0, f64::max);
    if highest > 0.0 {
        legend.push(LegendItem {
            fills: vec![],
            text: format!("activation memory (full row: {})", fmt_num(highest, 3)),
            line: true,
        });
    }
    let legend_font = 12.0;
    let swatch = |item: &LegendItem| 12.0 * item.fills.len().max(1) as f64;
    let mut legend_pos: Vec<(f64, f64)> = Vec::new();
    let (mut lx, mut ly) = (left, axis_y + 44.0);
    for item in &legend {
        let w = swatch(item) + 6.0 + text_width(&item.text, legend_font);
        if lx > left && lx + w > width - right {
            lx = left;
            ly += 20.0;
        }
        legend_pos.push((lx, ly));
        lx += w + 22.0;
    }
    let footer_y = if legend.is_empty() {
        axis_y + 44.0
    } else {
        ly + 26.0
    };
    let height = footer_y + 14.0;

    let mut o = String::with_capacity(256 + 320 * placed(p, t).count());
    let _ = writeln!(o, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="Helvetica, Arial, sans-serif">"#,
        w = px(width),
        h = px(height)
    );
    // Patterns: grey hatch for waiting, one hatch per recompute colour.
    o.push_str("<defs>\n");
    o.push_str(concat!(
        r##"<pattern id="mpipe-wait" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">"##,
        r##"<rect width="5" height="5" fill="#d4d4d4"/><line x1="0" y1="0" x2="0" y2="5" stroke="#8a8a8a" stroke-width="2"/></pattern>"##,
        "\n"
    ));
    for &(bg, fg) in &hatches {
        let _ = writeln!(
            o,
            r#"<pattern id="mpipe-rf-{bg:06x}-{fg:06x}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="{b}"/><line x1="0" y1="0" x2="0" y2="6" stroke="{f}" stroke-width="2"/></pattern>"#,
            b = hex(bg),
            f = hex(fg)
        );
    }
    o.push_str("</defs>\n");
    o.push_str("<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n");
    if let Some(title) = &opts.title {
        let _ = writeln!(
            o,
            r##"<text x="{x}" y="28" font-size="17" font-weight="bold" fill="#222222">{t}</text>"##,
            x = px(left),
            t = esc(title)
        );
    }

    // Rows: grey background (idle shows as blank) and labels.
    o.push_str("<g class=\"rows\">\n");
    for r in 0..nrows {
        let y = y_of(r);
        let _ = writeln!(
            o,
            r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="#eeeeee"/><text x="{lx}" y="{ty}" font-size="12" text-anchor="end" fill="#333333">rank {r}</text>"##,
            x = px(left),
            y = px(y),
            w = px(plot_w),
            h = px(row_h),
            lx = px(left - 8.0),
            ty = px(y + row_h / 2.0 + 4.0),
        );
    }
    o.push_str("</g>\n");

    // Ticks: gridlines through the rows, marks and labels under them.
    let step = tick_step(span, plot_w / 90.0);
    let nticks = (span / step + 1e-9).floor() as usize;
    o.push_str("<g class=\"axis\" font-size=\"11\" fill=\"#444444\" text-anchor=\"middle\">\n");
    let _ = writeln!(
        o,
        r##"<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#666666" stroke-width="1"/>"##,
        x0 = px(left),
        x1 = px(left + plot_w),
        y = px(axis_y)
    );
    for i in 0..=nticks {
        let time = i as f64 * step;
        let x = px(x_of(time));
        if nrows > 0 {
            let _ = write!(
                o,
                r##"<line x1="{x}" y1="{y0}" x2="{x}" y2="{y1}" stroke="#ffffff" stroke-width="1"/>"##,
                y0 = px(top),
                y1 = px(rows_bottom)
            );
        }
        let _ = writeln!(
            o,
            r##"<line x1="{x}" y1="{y0}" x2="{x}" y2="{y1}" stroke="#666666" stroke-width="1"/><text x="{x}" y="{ty}">{label}</text>"##,
            y0 = px(axis_y),
            y1 = px(axis_y + 5.0),
            ty = px(axis_y + 18.0),
            label = tm(time)
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{x}" y="{y}" text-anchor="end" font-style="italic">time</text>"#,
        x = px(left + plot_w),
        y = px(axis_y + 32.0)
    );
    o.push_str("</g>\n");

    // Actions, one group per rank.
    // One label size for the whole chart (mixed sizes read badly): the largest
    // that fits at least half of the boxes, and no labels at all if that is
    // below a legible minimum.
    // A model cut layer by layer (`layers`) is drawn a box per stage task: the runs
    // of one rank's layer tasks of one kind, micro-batch and model part that follow
    // each other without a wait between them are one box.
    let drawn = runs(p, t);
    let label_size = {
        let mut widths: Vec<f64> = Vec::new();
        let mut digits = 1;
        for d in &drawn {
            if let ActionRef::Compute(c) = d.action.view() {
                widths.push(box_width((d.slot.end - d.slot.start) * scale));
                digits = digits.max(c.mb.to_string().len());
            }
        }
        widths.sort_by(f64::total_cmp);
        let median = widths.get(widths.len() / 2).copied().unwrap_or(0.0);
        (row_h * 0.46).min(14.0).min(label_size_for(median, digits))
    };
    let mut current_rank = usize::MAX;
    for d in &drawn {
        let (r, a, s) = (d.rank, d.action, d.slot);
        if r != current_rank {
            if current_rank != usize::MAX {
                o.push_str("</g>\n");
            }
            let _ = writeln!(o, r#"<g class="rank" data-rank="{r}">"#);
            current_rank = r;
        }
        if !(s.start.is_finite() && s.end.is_finite()) {
            continue;
        }
        let y = y_of(r);
        let x0 = x_of(s.start);
        let w = (x_of(s.end) - x0).max(0.0);
        // Work for the next step (`Program::prefetch`) says so.
        let hit = |unit: &str, mb: usize| p.prefetch.iter().any(|e| &*e.unit == unit && e.mb == mb);
        let ahead = match a {
            Action::F { unit, mb }
            | Action::SEND {
                tensor: Tensor::Act,
                unit,
                mb,
                ..
            }
            | Action::RECV {
                tensor: Tensor::Act,
                unit,
                mb,
                ..
            } => !p.prefetch.is_empty() && hit(unit, *mb as usize),
            _ => false,
        };
        let name = match d.last {
            Some(last) => match a.view() {
                ActionRef::Compute(c) => {
                    format!("{}({}..{}, {})", c.op.as_str(), c.unit, last, c.mb)
                }
                _ => a.to_string(),
            },
            None => a.to_string(),
        };
        let tip = |what: &str| {
            format!(
                "{}{} · rank {r} · {what}{} → {} ({})",
                name,
                if ahead { " for the next step" } else { "" },
                tm(s.start),
                tm(s.end),
                tm(s.end - s.start)
            )
        };
        match a.view() {
            ActionRef::Compute(c) => {
                let look = look_of(c.unit);
                let kind = Kind {
                    encoder: look.encoder,
                    op: c.op,
                };
                let f = fill(kind, look);
                let bw = box_width(w);
                let class = if look.encoder {
                    format!("op {} enc", c.op.as_str())
                } else {
                    format!("op {}", c.op.as_str())
                };
                let _ = writeln!(
                    o,
                    r#"<rect class="{class}" x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}"><title>{tip}</title></rect>"#,
                    x = px(x0),
                    y = px(y),
                    w = px(bw),
                    h = px(row_h),
                    fill = f.attr(),
                    tip = esc(&tip(""))
                );
                let text = c.mb.to_string();
                let size = label_size;
                if size >= MIN_LABEL && label_size_for(bw, text.len()) >= size {
                    let ink = if luminance(f.background()) < 0.6 {
                        "#ffffff"
                    } else {
                        "#1a1a1a"
                    };
                    let _ = writeln!(
                        o,
                        r#"<text x="{x}" y="{y}" font-size="{size}" text-anchor="middle" fill="{ink}" pointer-events="none">{text}</text>"#,
                        x = px(x0 + bw / 2.0),
                        y = px(y + row_h / 2.0 + size * 0.36),
                        size = px(size)
                    );
                }
            }
            ActionRef::P2p(_) | ActionRef::Coll(_) => {
                if s.end > s.start {
                    let bh = (row_h * 0.3).max(3.0);
                    let _ = writeln!(
                        o,
                        r#"<rect class="wait" x="{x}" y="{y}" width="{w}" height="{h}" fill="url(#mpipe-wait)"><title>{tip}</title></rect>"#,
                        x = px(x0),
                        y = px(y + (row_h - bh) / 2.0),
                        w = px(w.max(0.6)),
                        h = px(bh),
                        tip = esc(&tip("waited "))
                    );
                }
            }
        }
    }
    if current_rank != usize::MAX {
        o.push_str("</g>\n");
    }

    // Memory: a step line per row, from 0 at time 0 to the end of the step.
    if highest > 0.0 {
        o.push_str("<g class=\"memory\" fill=\"none\" stroke=\"#c2185b\" stroke-width=\"1.4\">\n");
        for (r, steps) in memory.iter().enumerate() {
            let base = y_of(r) + row_h;
            let y = |level: f64| base - (level / highest).clamp(0.0, 1.0) * (row_h - 2.0);
            let mut d = format!("M{} {}", px(x_of(0.0)), px(base));
            let mut level = 0.0;
            let mut peak = 0.0f64;
            for &(time, next) in steps {
                if !(time.is_finite() && next.is_finite()) {
                    continue;
                }
                let x = px(x_of(time));
                let _ = write!(d, " L{x} {} L{x} {}", px(y(level)), px(y(next)));
                level = next;
                peak = peak.max(next);
            }
            let _ = write!(d, " L{} {}", px(x_of(span)), px(y(level)));
            let _ = writeln!(
                o,
                r#"<path d="{d}"><title>rank {r}: activation memory, peak {}</title></path>"#,
                fmt_num(peak, 3)
            );
        }
        o.push_str("</g>\n");
    }

    // Legend.
    o.push_str("<g class=\"legend\" font-size=\"12\" fill=\"#333333\">\n");
    for (item, &(x, y)) in legend.iter().zip(&legend_pos) {
        let fills: Vec<String> = if item.line {
            // A step of the memory line instead of a box.
            let _ = write!(
                o,
                r##"<path d="M{x0} {y0} L{x1} {y0} L{x1} {y1} L{x2} {y1}" fill="none" stroke="#c2185b" stroke-width="1.4"/>"##,
                x0 = px(x),
                x1 = px(x + 6.0),
                x2 = px(x + 12.0),
                y0 = px(y),
                y1 = px(y - 8.0)
            );
            Vec::new()
        } else if item.fills.is_empty() {
            vec!["url(#mpipe-wait)".to_string()]
        } else {
            item.fills.iter().map(|f| f.attr()).collect()
        };
        for (i, f) in fills.iter().enumerate() {
            let _ = write!(
                o,
                r#"<rect x="{x}" y="{y}" width="12" height="12" fill="{f}"/>"#,
                x = px(x + 12.0 * i as f64),
                y = px(y - 10.0)
            );
        }
        let _ = writeln!(
            o,
            r#"<text x="{x}" y="{y}">{t}</text>"#,
            x = px(x + swatch(item) + 6.0),
            y = px(y),
            t = esc(&item.text)
        );
    }
    o.push_str("</g>\n");

    // Footer.
    let footer = match &opts.subtitle {
        Some(s) => s.clone(),
        None => {
            let bubble = if makespan > 0.0 && nrows > 0 {
                1.0 - compute_time / (nrows as f64 * makespan)
            } else {
                0.0
            };
            format!(
                "makespan {} · bubble ratio {}% · {} ranks × {} micro-batches",
                tm(makespan),
                fmt_num(bubble * 100.0, 2),
                nrows,
                p.microbatches
            )
        }
    };
    let _ = writeln!(
        o,
        r##"<text x="{x}" y="{y}" font-size="12" fill="#555555">{t}</text>"##,
        x = px(left),
        y = px(footer_y),
        t = esc(&footer)
    );
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::testutil::{big_example, check_xml, simulate_eager, small_program};

    fn count(s: &str, pat: &str) -> usize {
        s.matches(pat).count()
    }

    #[test]
    fn render_svg_small_program() {
        let p = small_program();
        let t = simulate_eager(&p);
        let opts = SvgOptions {
            title: Some("2 ranks <small> & \"quoted\"".into()),
            ..SvgOptions::default()
        };
        let svg = gantt_svg(&p, &t, &opts);
        check_xml(&svg).unwrap();
        // One box per compute action (16), two waits (rank 1's RECVs at 0..3, 5..6).
        assert_eq!(count(&svg, r#"<rect class="op "#), 16);
        assert_eq!(count(&svg, r#"class="op F""#), 4);
        assert_eq!(count(&svg, r#"class="op F enc""#), 2);
        assert_eq!(count(&svg, r#"class="op RF enc""#), 1);
        assert_eq!(count(&svg, r#"class="op BW""#), 2);
        assert_eq!(count(&svg, r#"class="op BW enc""#), 1);
        assert_eq!(count(&svg, r#"<rect class="wait""#), 2);
        // Every box has a title with its times.
        assert_eq!(count(&svg, "<title>"), 18);
        assert!(svg.contains("<title>F(vision,0) · rank 0 · 0 → 2 (2)</title>"));
        assert!(svg.contains("waited 0 → 3 (3)"));
        // Labels, legend, escaped title, default footer.
        assert!(svg.contains(">rank 0</text>") && svg.contains(">rank 1</text>"));
        assert!(svg.contains(">encoder F</text>") && svg.contains(">W weight grad</text>"));
        assert!(svg.contains(">waiting in a transfer</text>"));
        assert!(svg.contains("2 ranks &lt;small&gt; &amp; &quot;quoted&quot;"));
        // compute = 2+1+2+1+1+1+2+2+1+2+3 + 1+1+1+2+1 = 24 over 2 * 18.
        assert!(svg.contains("makespan 18 · bubble ratio 33.33% · 2 ranks × 2 micro-batches"));
        // Micro-batch labels fit at this size.
        assert!(svg.contains(r#"pointer-events="none">1</text>"#));
        // Deterministic.
        assert_eq!(svg, gantt_svg(&p, &t, &opts));
    }

    #[test]
    fn render_svg_memory_lines_on_request() {
        let p = small_program();
        let t = simulate_eager(&p);
        // Off by default.
        let plain = gantt_svg(&p, &t, &SvgOptions::default());
        assert!(!plain.contains("class=\"memory\""));
        let opts = SvgOptions {
            memory: true,
            ..SvgOptions::default()
        };
        let svg = gantt_svg(&p, &t, &opts);
        check_xml(&svg).unwrap();
        // One line per rank, each with its peak, scaled to the highest of them.
        let curves = memory_over_time(&p, &t).unwrap();
        let peaks: Vec<f64> = curves
            .iter()
            .map(|c| c.iter().map(|s| s.1).fold(0.0, f64::max))
            .collect();
        let highest = peaks.iter().copied().fold(0.0, f64::max);
        assert!(highest > 0.0);
        assert_eq!(count(&svg, "<path d=\"M"), 2 + 1); // and the legend's swatch
        for (r, peak) in peaks.iter().enumerate() {
            let tip = format!("rank {r}: activation memory, peak {}", fmt_num(*peak, 3));
            assert!(svg.contains(&tip), "{tip}");
        }
        let legend = format!(
            ">activation memory (full row: {})</text>",
            fmt_num(highest, 3)
        );
        assert!(svg.contains(&legend), "{legend}");
        // The boxes are the same as without the lines.
        assert_eq!(
            count(&svg, r#"<rect class="op "#),
            count(&plain, r#"<rect class="op "#)
        );
        // A timeline of another program draws no lines (and does not panic).
        let other = big_example(2, 4, 1, false).1;
        assert!(!gantt_svg(&p, &other, &opts).contains("class=\"memory\""));
    }

    #[test]
    fn render_svg_subtitle_and_narrow_boxes() {
        let p = small_program();
        let t = simulate_eager(&p);
        let opts = SvgOptions {
            width: 300.0,
            row_height: 10.0,
            title: None,
            subtitle: Some("sim: eager".into()),
            memory: false,
        };
        let svg = gantt_svg(&p, &t, &opts);
        check_xml(&svg).unwrap();
        assert!(svg.contains(">sim: eager</text>"));
        assert!(!svg.contains("makespan"));
        assert_eq!(count(&svg, r#"<rect class="op "#), 16);
    }

    #[test]
    fn render_svg_big_chunked_schedule() {
        let (p, t) = big_example(8, 32, 2, false);
        let computes = p
            .programs
            .iter()
            .flatten()
            .filter(|a| matches!(a.view(), ActionRef::Compute(_)))
            .count();
        assert!(computes > 1500);
        let svg = gantt_svg(&p, &t, &SvgOptions::default());
        let elements = check_xml(&svg).unwrap();
        assert!(elements > computes);
        assert_eq!(count(&svg, r#"<rect class="op "#), computes);
        // Chunk shading: llm.0 (chunk 0) and llm.15 (chunk 1) F differ in colour.
        assert!(svg.contains(">chunk 0</text>") && svg.contains(">chunk 1</text>"));
        let fill_of = |needle: &str| {
            let i = svg.find(needle).unwrap();
            let head = &svg[..i];
            let f = head.rfind("fill=\"").unwrap();
            head[f + 6..f + 13].to_string()
        };
        assert_ne!(fill_of("<title>F(llm.0,0)"), fill_of("<title>F(llm.15,0)"));
    }

    #[test]
    fn render_svg_empty_and_mismatched_inputs() {
        let p = small_program();
        let svg = gantt_svg(&p, &Timeline::default(), &SvgOptions::default());
        check_xml(&svg).unwrap();
        assert_eq!(count(&svg, r#"<rect class="op "#), 0);
        let mut t = simulate_eager(&p);
        t.ranks[0].truncate(3);
        let svg = gantt_svg(&p, &t, &SvgOptions::default());
        check_xml(&svg).unwrap();
        assert_eq!(count(&svg, r#"<rect class="op "#), 2 + 5);
    }
}
