"""The markdown tables of benchmarks.trainer_vs_plain, from its result dict: every contender, then each
compiled contender beside its eager twin."""
from __future__ import annotations


def ratio_text(stats: dict | None) -> str:
    return "" if stats is None else f"{stats['median']:.3f} ({stats['min']:.2f}-{stats['max']:.2f})"


def best_text(stats: dict | None) -> str:
    return "" if stats is None else f"{stats['best']:.3f}"


def markdown(r: dict, k: int) -> str:
    c, rows = r["config"], r["contenders"]
    v = r["versions"]
    lines = [
        f"{r['machine']}, {r['threads']} threads; torch {v['torch']}, DeepSpeed {v['deepspeed']}, "
        f"transformers {v['transformers']}.",
        f"GPT-2 '{c['model_size']}' (N = {r['n_params_matmul']:,} matmul parameters), sequence {c['seq_len']}, "
        f"micro-batch {c['micro_batch']}, {c['precision']}; median of {c['rounds']} alternating rounds x "
        f"{c['steps']} steps after a warm-up block. Peak {c['precision']} matmul "
        f"{r['peak_flops'] / 1e9:,.1f} GFLOP/s; FLOPs/token = {r['flops_formula']} = "
        f"{r['flops_per_token'] / 1e6:,.2f} M.", "",
        f"| contender | tokens/s | vs plain, median (min-max) | vs plain, best blocks | vs HF same stage, "
        f"median (min-max) | vs HF, best blocks | MFU | page faults / step | {r['memory_kind']} MB (above start) | "
        f"kept tensors MB | max abs Δloss vs plain, first {k} / all | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['tokens_per_s']:,.0f} | {ratio_text(row['vs_plain'])} | "
            f"{best_text(row['vs_plain'])} | {ratio_text(row['vs_hf_same_stage'])} | "
            f"{best_text(row['vs_hf_same_stage'])} | {row['mfu']:.1%} | {row['page_faults_per_step']:,.0f} | "
            f"{row['peak_memory_mb']:,.0f} ({row['peak_memory_mb'] - row['baseline_memory_mb']:+,.0f}) | "
            f"{row['state_mb']:,.1f} | {row['max_loss_diff_first_steps']:.1e} / {row['max_loss_diff_all_steps']:.1e} "
            f"| {row['final_loss']:.4f} |")
    lines += ["", f"plain = hand-written loop, dsN = AdvancedDeepSpeedTrainer at ZeRO N, hfN = HF Trainer with "
              f"deepspeed= the same config, plain2 = the plain loop again (its ratio to plain is the noise floor), "
              f"plain-kept = the plain loop with glibc's malloc keeping freed memory, as the trainer has it on a "
              f"CPU (helpers.runtime.keep_freed_memory; its ratio to plain is what that alone is worth). "
              f"Ratios > 1: faster. Median: of the per-round ratios (blocks of a round run close together); "
              f"best blocks: the fastest block of each, which other load on a shared machine can only slow "
              f"down. {len(rows['plain']['losses'])} steps each; "
              f"total {r['wall_s']:.0f} s."]
    return "\n".join(lines + compiled_markdown(r["compiled"]))


def compiled_markdown(compiled: dict) -> list[str]:
    if not compiled:
        return []
    lines = ["", "| compiled contender | vs its eager twin, median (min-max) | vs plain-compiled, median (min-max) | "
             "compile s | break-even steps |", "|---|---:|---:|---:|---:|"]
    for name, row in compiled.items():
        steps = row["break_even_steps"]
        lines.append(f"| {name} | {ratio_text(row['vs_eager'])} | {ratio_text(row['vs_plain_compiled'])} | "
                     f"{row['compile_s']:.1f} | {'never' if steps is None else f'{steps:,.0f}'} |")
    return lines + ["", "Compile s: the warm-up block's extra time over a steady block, less the eager twin's "
                    "(torch.compile's one-off cost, with an empty inductor cache). Break-even: steps after which "
                    "the compiled run, compile time included, has caught up with its eager twin."]
