//! A plugin histogram as the host keeps it: a count, a sum, the counts under Envoy's default
//! Prometheus buckets, and log-linear bins of two significant decimal digits for quantiles.
//!
//! Envoy keeps no samples either. Its histograms are Circonus log-linear histograms
//! (`circllhist`, used by `source/common/stats/histogram_impl.cc`): a value falls in the bin
//! of its first two significant digits, `/stats` prints quantiles approximated from the bins
//! (`hist_approx_quantile`), and `/stats/prometheus` counts per bucket. So does this host,
//! so that a live gateway recording a value per request for days holds as much as after a
//! minute (at most 100 bins below 100 and 90 per decade above, under 1,800 for all of
//! `u64`), and a `/stats` scrape costs the bins, not the requests.
//!
//! Unlike Envoy's, the bucket counts and the sum here are exact (kept as values arrive), not
//! approximated from the bins; quantiles below 100 are exact too.

use std::collections::BTreeMap;

/// Envoy's default histogram buckets (`source/common/stats/histogram_impl.h`,
/// `HistogramSettingsImpl::defaultBuckets`), which `/stats/prometheus` prints as `le`.
pub(crate) const DEFAULT_BUCKETS: [f64; 19] = [
    0.5,
    1.0,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1_000.0,
    2_500.0,
    5_000.0,
    10_000.0,
    30_000.0,
    60_000.0,
    300_000.0,
    600_000.0,
    1_800_000.0,
    3_600_000.0,
];

/// One plugin histogram's values, aggregated across the VMs that record it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Histogram {
    count: u64,
    sum: u64,
    /// Values at most each of [`DEFAULT_BUCKETS`].
    at_most: [u64; DEFAULT_BUCKETS.len()],
    /// Values by their bin's lower bound (the value with all but two significant digits
    /// zeroed).
    bins: BTreeMap<u64, u64>,
}

/// The lower bound of `value`'s bin: itself below 100, else its first two significant
/// digits followed by zeros.
fn bin_of(value: u64) -> u64 {
    let (mut digits, mut scale) = (value, 1u64);
    while digits >= 100 {
        digits /= 10;
        scale *= 10;
    }
    digits * scale
}

impl Histogram {
    pub(crate) fn record(&mut self, value: u64) {
        self.count += 1;
        self.sum = self.sum.saturating_add(value);
        for (count, le) in self.at_most.iter_mut().zip(DEFAULT_BUCKETS) {
            *count += u64::from(value as f64 <= le);
        }
        *self.bins.entry(bin_of(value)).or_default() += 1;
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their sum (saturating).
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// The `q` quantile (0 to 1) as the lower bound of the bin holding the value of rank
    /// `round((count - 1) × q)`: exact below 100, else to two significant digits. `None`
    /// when nothing was recorded.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let last = self.count.checked_sub(1)?;
        let rank = (last as f64 * q.clamp(0.0, 1.0)).round() as u64;
        let mut below = 0;
        for (&bin, &count) in &self.bins {
            below += count;
            if below > rank {
                return Some(bin);
            }
        }
        self.bins.keys().next_back().copied()
    }

    /// `(le, values at most le)` for each of Envoy's default buckets.
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        DEFAULT_BUCKETS.into_iter().zip(self.at_most)
    }

    /// Bins kept: what the histogram's memory grows with.
    pub fn bins(&self) -> usize {
        self.bins.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value sequence with every order of magnitude in it, without a random number
    /// generator: a multiplicative walk through `u64`, scaled down by a varying shift.
    fn values(n: usize) -> impl Iterator<Item = u64> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n).map(move |i| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            x >> (i % 64)
        })
    }

    #[test]
    fn a_million_values_of_every_size_keep_under_1800_bins() {
        let mut histogram = Histogram::default();
        for value in values(1_000_000) {
            histogram.record(value);
        }
        assert_eq!(histogram.count(), 1_000_000);
        assert!(histogram.bins() < 1_800, "{} bins", histogram.bins());
        // And a value seen again adds no bin.
        let bins = histogram.bins();
        for value in values(1_000) {
            histogram.record(value);
        }
        assert_eq!(histogram.bins(), bins);
    }

    #[test]
    fn counts_sums_and_buckets_are_those_of_the_values_themselves() {
        let recorded: Vec<u64> = values(20_000).map(|v| v % 5_000_000).collect();
        let mut histogram = Histogram::default();
        for &value in &recorded {
            histogram.record(value);
        }
        assert_eq!(histogram.count(), recorded.len() as u64);
        assert_eq!(histogram.sum(), recorded.iter().sum::<u64>());
        for (le, count) in histogram.buckets() {
            let expected = recorded.iter().filter(|&&v| v as f64 <= le).count() as u64;
            assert_eq!(count, expected, "le {le}");
        }
    }

    #[test]
    fn quantiles_are_exact_below_100_and_to_two_digits_above() {
        let mut small = Histogram::default();
        assert_eq!(small.quantile(0.5), None);
        for value in (0..100).rev() {
            small.record(value);
        }
        assert_eq!(
            [0.0, 0.5, 0.9, 0.99, 1.0].map(|q| small.quantile(q)),
            [Some(0), Some(50), Some(89), Some(98), Some(99)]
        );
        let recorded: Vec<u64> = values(10_000).map(|v| v % 10_000_000).collect();
        let mut sorted = recorded.clone();
        sorted.sort_unstable();
        let mut histogram = Histogram::default();
        for &value in &recorded {
            histogram.record(value);
        }
        for q in [0.0, 0.25, 0.5, 0.9, 0.99, 1.0] {
            let exact = sorted[((sorted.len() - 1) as f64 * q).round() as usize];
            assert_eq!(histogram.quantile(q), Some(bin_of(exact)), "q {q}");
        }
        assert_eq!(
            [42, 99, 100, 101, 109, 110, 2_549, 1_000_000, u64::MAX].map(bin_of),
            [
                42,
                99,
                100,
                100,
                100,
                110,
                2_500,
                1_000_000,
                18_000_000_000_000_000_000
            ]
        );
    }
}
