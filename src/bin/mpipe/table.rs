//! Plain-text tables for the terminal: columns padded to their widest cell.

/// A table with a header row; cells are right-aligned except the first column and
/// the columns marked with [`Table::left`].
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
    left: Vec<usize>,
}

/// The unit names a profile declares (`[units]`), for tables' headers: `None` where
/// it declares none (headers then name no unit, as before `[units]` existed).
#[derive(Clone, Debug, Default)]
pub(crate) struct Units {
    pub time: Option<String>,
    pub memory: Option<String>,
}

impl Units {
    pub(crate) fn of(profile: &mpipe_core::profile::Profile) -> Units {
        let u = profile.units.clone().unwrap_or_default();
        Units {
            time: u.time,
            memory: u.memory,
        }
    }

    /// `makespan (ms)`, or `makespan` when the time unit is not declared.
    pub(crate) fn time(&self, header: &str) -> String {
        with_unit(header, self.time.as_deref())
    }

    /// `peak memory (GiB)`, or `peak memory` when the memory unit is not declared.
    pub(crate) fn memory(&self, header: &str) -> String {
        with_unit(header, self.memory.as_deref())
    }
}

fn with_unit(header: &str, unit: Option<&str>) -> String {
    match unit {
        Some(u) => format!("{header} ({u})"),
        None => header.to_string(),
    }
}

/// What "peak memory" means in every table of the tool (`compare`, `evaluate`,
/// `simulate`, `check`): what `memory.limit` is compared with.
pub(crate) const PEAK_MEMORY_MEANS: &str =
    "peak memory: activations plus resident parameters, the largest over ranks";

impl Table {
    /// A table with owned header cells (headers that carry units).
    pub(crate) fn with_header(header: Vec<String>) -> Table {
        Table {
            rows: vec![header],
            left: vec![0],
        }
    }

    pub(crate) fn new(header: &[&str]) -> Table {
        Table {
            rows: vec![header.iter().map(|s| s.to_string()).collect()],
            left: vec![0],
        }
    }

    /// Left-align column `c` (for text).
    pub(crate) fn left(&mut self, c: usize) {
        self.left.push(c);
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let width: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for (i, row) in self.rows.iter().enumerate() {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                let pad = width[c] - cell.chars().count();
                if c > 0 {
                    line.push_str("  ");
                }
                if self.left.contains(&c) {
                    line.push_str(cell);
                    line.push_str(&" ".repeat(pad));
                } else {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
            if i == 0 {
                let total: usize = width.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
                out.push_str(&"-".repeat(total));
                out.push('\n');
            }
        }
        out
    }
}

/// A number with up to 3 decimals, trailing zeros trimmed.
pub(crate) fn num(x: f64) -> String {
    if x.is_infinite() {
        return "inf".into();
    }
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.to_string()
    }
}

/// A ratio as a percentage with one decimal.
pub(crate) fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let mut t = Table::new(&["name", "n", "note"]);
        t.left(2);
        t.row(vec!["a".into(), "10".into(), "x".into()]);
        t.row(vec!["bbb".into(), "2".into(), "longer".into()]);
        assert_eq!(
            t.render(),
            "name   n  note\n----------------\na     10  x\nbbb    2  longer\n"
        );
    }

    #[test]
    fn numbers() {
        assert_eq!(num(2.5), "2.5");
        assert_eq!(num(3.0), "3");
        assert_eq!(num(-0.0001), "0");
        assert_eq!(num(f64::INFINITY), "inf");
        assert_eq!(pct(0.2853), "28.5%");
    }
}
