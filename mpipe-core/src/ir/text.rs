//! Text helpers every floor's error messages share.

/// The closest candidate within edit distance 2, if any.
pub fn did_you_mean<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    // The nearest; on a tie, the first in `candidates` (their order is the caller's
    // preference, e.g. the order keys are documented in).
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (edit_distance(word, c), i, *c))
        .filter(|&(d, ..)| d <= 2)
        .min()
        .map(|(.., c)| c)
}

/// Optimal-string-alignment distance: insertions, deletions, substitutions and
/// transpositions of adjacent characters each cost 1 (a swap of two neighbouring
/// characters is the commonest typo). Behind every did-you-mean.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let w = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * w];
    for i in 0..=a.len() {
        d[i * w] = i;
    }
    for (j, cell) in d.iter_mut().enumerate().take(w) {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[(i - 1) * w + j] + 1)
                .min(d[i * w + j - 1] + 1)
                .min(d[(i - 1) * w + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[(i - 2) * w + j - 2] + 1);
            }
            d[i * w + j] = v;
        }
    }
    d[a.len() * w + b.len()]
}

#[cfg(test)]
mod tests {
    use super::did_you_mean;

    #[test]
    fn did_you_mean_counts_a_swap_as_one_edit_and_breaks_ties_by_order() {
        let keys = ["model", "model_toml", "ranks", "mode"];
        // `modle` is one swap from `model` and one deletion from `mode`: the tie
        // goes to the key listed first.
        assert_eq!(did_you_mean("modle", &keys), Some("model"));
        assert_eq!(did_you_mean("modle", &["mode", "model"]), Some("mode"));
        assert_eq!(did_you_mean("rnaks", &keys), Some("ranks"));
        assert_eq!(did_you_mean("moed", &keys), Some("mode"));
        assert_eq!(did_you_mean("schedule", &keys), None);
    }
}
