//! The report: markdown that goes into docs/scheduling.md as it is printed. Only the inputs and
//! the results appear in it (no timings), so a seed gives the same bytes every time.

use std::fmt::Write;

use crate::Simulation;
use crate::kube_scheduler::feasible_nodes_to_find;
use crate::workload::MS_PER_HOUR;

/// 1234567 as "1,234,567".
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.1} %", part as f64 * 100.0 / whole as f64)
}

fn hours(ms: u64) -> String {
    let h = ms as f64 / MS_PER_HOUR as f64;
    format!("{h}")
}

/// The report of `sim`, headed by the `command` that reproduces it.
pub fn markdown(sim: &Simulation, command: &str) -> String {
    let mut out = String::new();
    let shape = &sim.shape;
    let config = &sim.config;
    let mean_gib = sim.mix.mean_gib();
    let offered =
        sim.arrivals_per_minute * config.mean_lifetime_minutes * mean_gib / shape.capacity_gib() as f64;
    // Writing to a String cannot fail.
    let _ = writeln!(out, "`{command}`");
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{} nodes x {} GPUs of {} MiB = {} GPUs; {} units of 1 GiB per GPU ({} GiB in all), at least {} per pod, {} MPS clients per GPU.",
        thousands(u64::from(shape.nodes)),
        shape.gpus_per_node,
        config.cluster.gpu_memory_bytes >> 20,
        thousands(u64::from(shape.total_gpus())),
        shape.gib_per_gpu,
        thousands(shape.capacity_gib()),
        shape.min_units_per_process,
        shape.max_clients_per_gpu,
    );
    let mix: Vec<String> = sim
        .mix
        .sizes
        .iter()
        .map(|&(gib, w)| format!("{gib} GiB x{w}"))
        .collect();
    let _ = writeln!(
        out,
        "Seed {}: {} pods arriving at {:.1} per minute for {} h (offered memory {:.2} x capacity), mean lifetime {} min (exponential), asks {} (mean {:.2} GiB).",
        config.seed,
        thousands(sim.pods as u64),
        sim.arrivals_per_minute,
        hours(sim.window.end_ms),
        offered,
        config.mean_lifetime_minutes,
        mix.join(", "),
        mean_gib,
    );
    let _ = writeln!(
        out,
        "Scheduler: NodeResourcesFit {} on the GPU resource, scoring {} feasible nodes per pod; {} time-slicing replicas per GPU for A; a pod refused after scheduling holds its replica or request for {} s. Counted: pods arriving after a {} h warm-up.",
        config.strategies.scoring.name(),
        feasible_nodes_to_find(shape.nodes, config.strategies.percentage_of_nodes_to_score),
        config.strategies.replicas_per_gpu,
        config.strategies.failed_release_ms as f64 / 1000.0,
        hours(sim.window.warmup_ms),
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| Strategy | Pods arrived | Placed | Refused after scheduling | Unschedulable | GPU memory utilisation |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
    for r in &sim.results {
        let _ = writeln!(
            out,
            "| {} | {} | {} ({}) | {} ({}) | {} ({}) | {:.1} % |",
            r.name,
            thousands(r.arrived),
            thousands(r.placed),
            percent(r.placed, r.arrived),
            thousands(r.refused_total()),
            percent(r.refused_total(), r.arrived),
            thousands(r.unschedulable),
            percent(r.unschedulable, r.arrived),
            r.utilisation * 100.0,
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Pods placed, by memory asked (share of the pods of that size):"
    );
    let _ = writeln!(out);
    let letters: Vec<&str> = sim.results.iter().map(|r| letters_of(r.name)).collect();
    let _ = writeln!(out, "| Ask | Share of pods | {} |", letters.join(" | "));
    let _ = writeln!(out, "|---:|---:|{}", "---:|".repeat(letters.len()));
    let total_weight = sim.mix.total_weight().max(1);
    for &(gib, weight) in &sim.mix.sizes {
        let cells: Vec<String> = sim
            .results
            .iter()
            .map(|r| {
                let c = r.by_size.get(&gib).copied().unwrap_or_default();
                percent(c.placed, c.arrived)
            })
            .collect();
        let _ = writeln!(
            out,
            "| {gib} GiB | {} | {} |",
            percent(u64::from(weight), total_weight),
            cells.join(" | ")
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "Refusals after scheduling, by who refused:");
    let _ = writeln!(out);
    for r in &sim.results {
        if r.refused.is_empty() {
            let _ = writeln!(out, "- {}: none", letters_of(r.name));
        }
        for (reason, count) in &r.refused {
            let example = r.first_refusal.get(reason).map(String::as_str).unwrap_or("");
            let _ = writeln!(
                out,
                "- {}: {} by {}; the first: \"{}\"",
                letters_of(r.name),
                thousands(*count),
                reason.describe(),
                example
            );
        }
    }
    out
}

fn letters_of(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(percent(1, 3), "33.3 %");
        assert_eq!(percent(1, 0), "-");
        assert_eq!(hours(4 * MS_PER_HOUR), "4");
        assert_eq!(hours(MS_PER_HOUR / 2), "0.5");
    }
}
