"""Mutation check: break the code on purpose, one bug at a time, and make sure the tests notice.

    python scripts/mutants.py                # baseline (unmutated tests pass), then every mutant
    python scripts/mutants.py --only M1,M2a  # some mutants; --list prints them

Each mutant is one exact source replacement (it must match exactly once) applied to a fresh copy
of the work tree (tracked and untracked files, no venv) in a temp dir; the named tests then run
there with `python -m pytest -x -q`. Killed = pytest exits 1 (a test failed). A pass, or any other
exit (a collection error says the mutant broke the import, not the behaviour), is a survivor.
Exit status 1 if any mutant survives. M1-M5 are the audit's mutants of issue 9, K1-K2 the two it
found killed, N1-N12 guard what issue 9 (and the export fixes after it) added, S1-S2 and T1-T2 issue
10's speculative sampling and draft trees, F1-F11 issue 13's fast TTT step (flex block mask, fused loss,
checkpointing, causal kernel + log-sum-exp merge, one-graph unroll), O1-O4 its online training, B1-B5 its norm_before_fc, W1-W5 its resume onto another
number of processes, G1-G6 issue 14's static batched generation loop (G6: its CPU prefill in row
groups), P1-P3 data_gen's pool of requests across parts (full `hf` calls), P4-P5 its stop on SIGTERM, P6 its
rerun after kill -9, A1-A3 the grouped decode attention
(core/engine/decode_attention.py), D1-D2 data_gen's `dataset` backend (the source's answers), Q1-Q7 issue 13's
sequence packing (train.kernels.pack_length), H1-H4 its bf16 weights with fp32 masters (train.kernels.bf16_weights),
E1-E2 train/drafter_accuracy.py (teacher-forced accuracy of an exported drafter), R1-R3 the eager TTT
steps pruned to the rows a later step counts (TTTObjective's prune_rows), KM1-KM6 issue 48's Kimi-K2.5 failures
put back (tests/test_kimi_chain.py) and its one-server-at-a-time eval, V1-V10 issue 50's unfinished upstream,
conversations part checksums, logs of a run killed before its first checkpoint and eval on training prompts, the lossless check, loss decay
and gradient clipping in the gradient, RoPE's direction, the norms' placement and a full disk
in safetensors' words, V11-V13 reader locks and the gradient between TTT
steps, B6-B9 EAGLE-3.1's fc_norm and norm_output, L1-L9 issue 51's MLA draft layer, Z1-Z6 issue 52's
DeepSpeed runs, VL1-VL4 issue 53's vLLM exports, VX1-VX3 issue 56's
stock vLLM extraction, DF1-DF6 issue 54's DFlash drafters, LK1-LK5 issue 66's LK losses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]

    def apply(self, source: str) -> str:
        """`source` (the text of `file`) with the bug put in: the replacement must match exactly once."""
        if source.count(self.old) != 1:
            raise ValueError(f"mutant {self.name}: {self.file} holds {source.count(self.old)} copies of {self.old!r}, "
                             "need exactly 1")
        return source.replace(self.old, self.new)


ALIGN = ("tests/test_draft_alignment.py",)
VLLM = "tests/test_vllm_export.py"
VX = "tests/test_extract_vllm.py"
DFL = "tests/test_dflash.py"
RESUME = ("tests/test_resume.py",)
WORLD = ("tests/test_resume.py::test_two_processes_stop_and_one_process_finishes_as_if_never_stopped",
         "tests/test_resume.py::test_one_process_stop_and_two_processes_finish_every_sample_once")
SAMPLING = ("tests/test_speculative_modes.py::test_speculative_sampling_at_t1_keeps_the_target_distribution",)
FAST = ("tests/test_ttt_fast_paths.py",)
LKT = "tests/test_lk_loss.py"
PACKING = ("tests/test_packing.py",)
KIMI = ("tests/test_kimi_chain.py",)
NORM_FC = ("tests/test_drafter.py",)
MLA = ("tests/test_mla_drafter.py",)
DS = "tests/test_deepspeed.py"
TREE = ("tests/test_speculative_modes.py::test_tree_at_t0_writes_the_greedy_output",)
ONLINE = ("tests/test_train_online.py",)
STATIC = ("tests/test_generate_static.py",)
POOL = ("tests/test_data_gen_hf_pool.py",)
TERM = ("tests/test_data_gen_hf_pool.py::test_sigterm_commits_every_finished_conversation_and_a_rerun_does_only_the_rest",)
DECODE_ATTN = ("tests/test_decode_attention.py",)
DATASET = "tests/test_data_gen_dataset.py::"
P_MIN_TESTS = ("tests/test_decode.py::test_draft_confidence_is_llamacpps_top10_probability",
               "tests/test_decode.py::test_p_min_stops_each_chain_at_the_first_unsure_draft")
MUTANTS = [
    Mutant("M1", "resume skips accelerator.load_state (fresh weights, old step counter)", "train/checkpoint.py",
           '    accelerator.load_state(str(ckpt_root / latest["path"]))\n', "", RESUME),
    Mutant("M2a", "draft cache never rolled back after a verification", "core/engine/speculative.py",
           "        dcache.rollback(m)", "        pass", ALIGN),
    Mutant("M2b", "decode-time draft RoPE position m+j -> m+j+1", "core/engine/speculative.py",
           "torch.tensor([[m + j]], device=hidden.device)", "torch.tensor([[m + j + 1]], device=hidden.device)",
           ALIGN),
    Mutant("M3c", "TTT step k loses its RoPE offset", "train/ttt_loss.py",
           "token_qkv, pos = tuple(y[:, k:k + t] for y in all_steps), positions + k",
           "token_qkv, pos = tuple(y[:, k:k + t] for y in all_steps), positions", ALIGN),
    Mutant("M3d", "TTT step k reads x[t+1] instead of x[t+k+1]", "train/ttt_loss.py",
           "tuple(y[:, k:k + t] for y in all_steps)", "tuple(y[:, :t] for y in all_steps)", ALIGN),
    Mutant("M4a", "optimizer step removed", "train/fit.py", "        f.opt.step()\n", "", RESUME),
    Mutant("M4b", "per-position acceptance counts a >= i+1", "eval/report.py",
           "sum(a > i + 1 for a in lengths)", "sum(a >= i + 1 for a in lengths)",
           ("tests/test_decode.py::test_scripted_partial_accepts_give_exact_lengths_and_per_position_acceptance",)),
    Mutant("M5", "SGLang plugin's BEFORE hook returns at once (no D2H copy queued)", "extract/sglang_plugin.py",
           "    self = args[0]", "    return",
           ("tests/test_sglang_plugin.py::test_before_hook_queues_the_final_states_through_sglangs_async_d2h",)),
    Mutant("K1", "teacher shifted k+1 -> k", "train/ttt_loss.py",
           "rows.append(bi * t + ti + k + 1)", "rows.append(bi * t + ti + k)", ALIGN),
    Mutant("K2", "aux_scale not folded into fc on export", "core/drafters/drafter.py",
           'sd["fc.weight"] = (sd["fc.weight"] / self.aux_scale.cpu()).contiguous()',
           'sd["fc.weight"] = sd["fc.weight"].contiguous()', ("tests/test_drafter.py",)),
    Mutant("N1", "a stop id accepted mid-chain does not end the round's output", "core/engine/speculative.py",
           "            candidates = candidates[: i + 1]", "            pass",
           ("tests/test_decode.py::test_accepted_stop_id_ends_generation_and_no_later_round_counts",)),
    Mutant("N2", "the target's static cache is not moved back to the verified position", "core/engine/decode.py",
           "    _seek(cache, start)\n", "",
           ("tests/test_decode.py::test_speculative_equals_greedy_with_untrained_drafter",)),
    Mutant("N3", "draft cache mask hides the query's own slot", "core/drafters/drafter.py",
           "mask = slots[None, :] <= torch.arange(", "mask = slots[None, :] < torch.arange(", ALIGN),
    Mutant("N4", "logged loss ignores the per-step decay", "train/ttt_loss.py",
           "sum(decay ** k * lk for", "sum(lk for", ("tests/test_drafter.py::test_metrics_are_ratios_of_summed_counts",)),
    Mutant("N5", "logged metrics not divided by the summed counts", "train/ttt_loss.py",
           'n = sums["count"].clamp(min=1)', 'n = torch.ones_like(sums["count"])',
           ("tests/test_drafter.py::test_metrics_are_ratios_of_summed_counts",)),
    Mutant("N6", "check_compat passes when a key is missing", "core/storage/manifest.py",
           "        if key not in have:", "        if False:",
           ("tests/test_config.py::test_check_compat_refuses_a_missing_or_different_key",)),
    Mutant("N7", "resume replays the epoch's first batches (the samples done in the epoch ignored)", "train/fit.py",
           "        done = batches_done(batches, epoch_samples, where)\n", "        done = 0\n", RESUME),
    Mutant("N8", "verification accepts one draft too many", "core/engine/speculative.py",
           "accepted, rows, n_drafts = drafts[:a], list(range(a + 1)), len(drafts)",
           "accepted, rows, n_drafts = drafts[:a + 1], list(range(a + 1)), len(drafts)",
           ("tests/test_decode.py",)),
    Mutant("N9", "the accepted tokens are re-read with the drafts' aux offset by one", "core/engine/speculative.py",
           "d_logits, h = drafter(aux[:, rows]", "d_logits, h = drafter(aux[:, [min(r + 1, aux.shape[1] - 1) for r in rows]]",
           ALIGN),
    Mutant("N10", "llama.cpp's top-level layer ids exported shifted by one", "core/drafters/drafter_config.py",
           '"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),\n',
           '"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.aux_layers],\n', ("tests/test_aux_layers.py",)),
    Mutant("N12", "no top-level layer ids: llama.cpp falls back to [2, L//2, L-3]", "core/drafters/drafter_config.py",
           '"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),\n', "\n",
           ("tests/test_llamacpp_export.py", VLLM)),
    Mutant("F1", "flex TTT mask: a query no longer sees its own step-0 key", "train/ttt_attention.py",
           "        step0 = pos <= q_idx\n", "        step0 = pos < q_idx\n", FAST),
    Mutant("F2", "TTT block mask skips the diagonal block of later steps", "train/ttt_attention.py",
           "*[diag.expand_as(part0)] * (steps - 1)]", "*[torch.zeros_like(part0)] * (steps - 1)]", FAST),
    Mutant("F3", "fused head loss forgets the per-step weights in its gradient", "train/draft_head_loss.py",
           "    g = g * scale[:, None]\n", "    g = g\n", FAST),
    Mutant("F4", "activation checkpointing recomputes with the grown key list", "train/ttt_loss.py",
           "tuple(keys), tuple(values), masks[k],", "keys, values, masks[k],", FAST),
    Mutant("F8", "train.kernels.compile=unroll runs the plain per-step loop (the one-graph unroll never runs)",
           "train/ttt_loss.py", "    if options.unroll:", "    if False:", FAST),
    Mutant("F9", "the merged TTT attention hands the step's strided views to its kernel (a GPU gave 10-100% errors)",
           "train/ttt_attention.py",
           "_MergedAttention.apply(q.contiguous(), *(k.contiguous() for k in keys), *(v.contiguous() for v in values))",
           "_MergedAttention.apply(q, *keys, *values)", FAST),
    Mutant("F10", "train uses the cudnn attention without checking it on the device first", "train/loop.py",
           "        check_merged_attention(accelerator.device, mla=dc.mla is not None)", "        pass",
           ("tests/test_train_online.py",)),
    Mutant("F11", "the attention check lets any gradient error through", "train/attention_check.py",
           "    if errors[worst] > LIMIT:", "    if errors[worst] > 100 * LIMIT:", FAST),
    Mutant("H1", "bf16 weights: the checkpoint loses the fp32 masters (a resume continues from the rounded weights)",
           "train/master_weights.py", "                m.copy_(saved)", "                pass", ("tests/test_master_weights.py",)),
    Mutant("H2", "bf16 weights: the masters step but are never written back to the weights",
           "train/master_weights.py", "            p.copy_(m)", "            pass", ("tests/test_master_weights.py",)),
    Mutant("H3", "train.kernels.bf16_weights trains with plain AdamW on the bf16 weights", "train/loop.py",
           "optimizer = MasterWeightAdamW if tc.kernels.bf16_weights else torch.optim.AdamW",
           "optimizer = torch.optim.AdamW", ("tests/test_master_weights.py",)),
    Mutant("H4", "the loop's learning rate never reaches the masters' AdamW", "train/master_weights.py",
           "            inner.update({k: v for k, v in outer.items() if k != \"params\"})  # the lr the loop set",
           "            pass", ("tests/test_master_weights.py",)),
    Mutant("E1", "drafter_accuracy feeds each sample's features misaligned with its tokens",
           "train/drafter_accuracy.py", 'Rows(b["aux"],', 'Rows(b["aux"].flip(1),',
           ("tests/test_tau_probe.py",)),
    Mutant("E2", "drafter_accuracy scores features of other aux layers than the drafter's", "train/drafter_accuracy.py",
           '"aux_layers": list(drafter.config.aux_layers)}', "}", ("tests/test_tau_probe.py",)),
    Mutant("F5", "merged TTT attention: the causal part is not rescaled by the merged log-sum-exp",
           "train/ttt_attention.py", "out = out0.float() * (lse0 - lse).exp()[..., None]", "out = out0.float()", FAST),
    Mutant("F6", "merged TTT attention's backward drops the diagonal keys' share of dq", "train/ttt_attention.py",
           "        dq = dq + ds[..., None] * kg * scale\n", "        dq = dq\n", FAST),
    Mutant("F7", "merged TTT attention's backward forgets the softmax row term for the diagonal scores",
           "train/ttt_attention.py", "ds = p * ((dog * vg).sum(-1) - delta)", "ds = p * (dog * vg).sum(-1)", FAST),
    Mutant("R1", "pruned steps keep only the rows their own step counts, not a later step's", "train/ttt_loss.py",
           "        union = union | masks[k]", "        union = masks[k]", FAST),
    Mutant("R2", "pruned steps take the previous step's hidden of the wrong rows", "train/ttt_loss.py",
           "hidden, token_qkv, pos = hidden[rows[0]], tuple(y[rows[0]] for y in token_qkv), pos[rows[0]]",
           "hidden, token_qkv, pos = hidden[rows[0]].roll(1, 0), tuple(y[rows[0]] for y in token_qkv), pos[rows[0]]", FAST),
    Mutant("R3", "pruned steps scatter their keys to the wrong positions", "train/ttt_loss.py",
           "        return scatter_rows(x[0].transpose(0, 1), where, b, t).transpose(1, 2)",
           "        return scatter_rows(x[0].transpose(0, 1), where, b, t).roll(1, 1).transpose(1, 2)", FAST),
    Mutant("Q1", "dense TTT attention without the document mask: a packed row reads the documents before",
           "train/ttt_attention.py", "        visible = visible & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])",
           "        pass", PACKING),
    Mutant("Q2", "no boundary loss mask: a row whose x[t+k+2] is the next document's counts", "train/ttt_loss.py",
           "return m if doc_ids is None else m & (shift_left(doc_ids, k + 2) == doc_ids)", "return m", PACKING),
    Mutant("Q3", "flex's mask_mod without the document mask", "train/ttt_attention.py",
           "            step0 = step0 & (doc_ids[b, pos] == doc_ids[b, q_idx])", "            pass", PACKING),
    Mutant("Q4", "document block mask skips the blocks a document crosses into", "train/ttt_attention.py",
           "    part0 = diag | (before & ~full0 & (last[:, None, :] == first[:, :, None]))",
           "    part0 = diag.expand_as(full0)", PACKING),
    Mutant("Q5", "teacher rows at a document's last token (its next token is another document's)",
           "core/storage/hidden_shards.py", "        need[..., :-1] &= doc_ids[..., 1:] == doc_ids[..., :-1]", "        pass",
           PACKING),
    Mutant("Q6", "train/fit.py packs the batch but gives the objective no doc ids / positions", "train/fit.py",
           "mask, teacher, doc_ids, positions, generator=draws)", "mask, teacher, generator=draws)", PACKING),
    Mutant("Q7", "train/fit.py gives the objective row-wide positions (RoPE is relative: the loss hardly moves)",
           "train/fit.py", "mask, teacher, doc_ids, positions, generator=draws)",
           "mask, teacher, doc_ids, None, generator=draws)", PACKING),
    Mutant("S1", "speculative sampling draws a rejected draft's replacement from p, not max(p - q, 0)",
           "core/engine/speculative.py", "residual = (p[j] - q).clamp(min=0)", "residual = p[j].clone()", SAMPLING),
    Mutant("S2", "speculative sampling accepts every draft", "core/engine/speculative.py",
           "if torch.rand((), generator=generator, device=p.device) * q[x] < p[j, x]:", "if True:", SAMPLING),
    Mutant("X1", "p_min compares the full-vocab softmax, not llama.cpp's top-10 one", "core/engine/speculative.py",
           "top = logits.float().topk(min(10, logits.shape[-1])).values", "top = logits.float().sort(descending=True).values",
           (P_MIN_TESTS[0],)),
    Mutant("X2", "p_min never stops a chain", "core/engine/speculative.py",
           "        if p_min > 0 and draft_confidence(logits[0]) < p_min:\n            break\n", "", P_MIN_TESTS),
    Mutant("X3", "τ counts the plain steps of rounds p_min stopped before their first draft", "eval/report.py",
           "lengths = [a for a, d in rounds if d > 0]", "lengths = [a for a, d in rounds]", P_MIN_TESTS[1:]),
    Mutant("T1", "tree verification: every node sees every other node (no ancestor mask)", "core/engine/speculative.py",
           "mask[0, 0, 1:, m + 1: m + 1 + n] = tree.visible().to(model.device)",
           "mask[0, 0, 1:, m + 1: m + 1 + n] = True", TREE),
    Mutant("T2", "the accepted tree path's K/V are not moved to the chain slots", "core/engine/speculative.py",
           "            _compact(cache, [m + 1 + i for i in path], m + 1)\n", "", TREE),
    Mutant("O1", "online captures read the aux layers shifted by one", "train/online.py",
           "capture(self.model, ids, valid.long(), self.aux_layers,",
           "capture(self.model, ids, valid.long(), [i + 1 for i in self.aux_layers],", ONLINE),
    Mutant("O2", "online teacher argmax ignores train.loss_on_prompt", "train/online.py",
           'teacher_positions(batch["valid"] if self.on_prompt else batch["loss_mask"])',
           'teacher_positions(batch["loss_mask"])', ONLINE),
    Mutant("O3", "online draft vocab counted over every token, not the loss-masked ones", "train/online.py",
           '            yield s["input_ids"], s["loss_mask"]', '            yield s["input_ids"], s["input_ids"] * 0 + 1',
           ONLINE),
    Mutant("O4", "online samples in conversation order, not the shards' sorted ids", "train/online.py",
           "order = sorted(range(len(ids)), key=ids.__getitem__)", "order = list(range(len(ids)))", ONLINE),
    Mutant("W1", "a launch on another world size keeps grad_accum (2 -> 1 process halves the run's global batch)",
           "train/loop.py", "accum = accum_for(step_batches, world)", "accum = tc.grad_accum", WORLD),
    Mutant("W2", "aux noise drawn from each process's global RNG, not from the batch's own stream", "train/fit.py",
           "torch.rand(aux.shape, generator=g,", "torch.rand(aux.shape, generator=None,", WORLD),
    Mutant("W3", "the empty slot at an epoch's end trains its batch again", "train/position.py",
           "else Slot(start, 0.0, start, end)", "else Slot(start, 1.0, start, end)", WORLD),
    Mutant("W4", "the data position restored as batches of this launch's ranks (old skip_first_batches count)",
           "train/fit.py", "        done = batches_done(batches, epoch_samples, where)\n",
           "        done = batches_done(batches, epoch_samples, where) // world\n", WORLD),
    Mutant("W5", "every process starts its own W&B run (not rank 0 alone)", "train/loop.py",
           "accelerator.init_trackers(cfg.train.wandb_project, config=to_dict(cfg), init_kwargs={\n"
           "            \"wandb\": {\"dir\": str(train_dir), \"name\": cfg.name, \"mode\": cfg.train.wandb_mode}})",
           "__import__(\"wandb\").init(project=cfg.train.wandb_project, config=to_dict(cfg),\n"
           "            **{\"dir\": str(train_dir), \"name\": cfg.name, \"mode\": cfg.train.wandb_mode})", WORLD[:1]),
    Mutant("N11", "atomic writes keep the writer's 0600 mode", "core/storage/atomic_io.py",
           "        os.chmod(tmp, FILE_MODE)\n", "",
           ("tests/test_pipeline.py::test_outputs_are_readable_by_other_users",)),
    Mutant("B1", "norm_before_fc not written to config.json", "core/drafters/drafter_config.py",
           'cfg["norm_before_fc"] = True', "pass", NORM_FC),
    Mutant("B2", "aux_scale applied before input_norm (cannot be folded into fc on export)", "core/drafters/drafter.py",
           "            hidden = self.fc(self.fc_input(hidden) / self.aux_scale)",
           "            hidden = self.fc(self.fc_input(hidden / self.aux_scale))",
           NORM_FC),
    Mutant("B3", "the decode/TTT forward skips input_norm", "core/drafters/drafter.py",
           "            aux = self.input_norm(aux)\n", "            pass\n", NORM_FC),
    Mutant("B4", "from_pretrained ignores norm_before_fc", "core/drafters/drafter_config.py", "    return bool(top)", "    return False",
           NORM_FC),
    Mutant("B5", "convert_drafter does not check the GGUF's norm_before_fc", "eval/llamacpp.py",
           "    if gguf_norm_before_fc(gguf) != want:", "    if False:",
           ("tests/test_llamacpp_export.py::test_conversion_that_loses_norm_before_fc_is_refused",)),
    Mutant("G1", "batched sampling leaves the generator past the draws the plain loop makes", "core/engine/decode.py",
           "        generator.set_state(states[", "        (states[", STATIC),
    Mutant("G2", "the every-N-steps done check never ends the loop", "core/engine/decode.py",
           "            if bool(torch.isin(out[:, :i + 1], stop).any(-1).all()):", "            if False:", STATIC),
    Mutant("G3", "the static mask hides the generated tokens' slots", "core/engine/decode.py",
           "mask.new_ones(b, max_new_tokens)", "mask.new_zeros(b, max_new_tokens)", STATIC),
    Mutant("G4", "decode positions never advance", "core/engine/decode_step.py", "        self.positions.add_(1)\n", "",
           STATIC),
    Mutant("G5", "data_gen.compile=fused decodes eagerly (the compiled step never runs)", "core/engine/decode_step.py",
           "return _fused_forward(FUSE_BACKEND, self.fuse)(self)", "return self._forward()",
           STATIC),
    Mutant("G6", "a grouped CPU prefill copies its groups' keys into the cache in reverse order", "core/engine/decode.py",
           "torch.cat([g[i].keys for g in groups])", "torch.cat([g[i].keys for g in groups[::-1]])",
           ("tests/test_generate_static.py::test_a_cpu_prefill_in_groups_of_rows_gives_the_one_pass_logits_and_tokens",)),
    Mutant("P1", "a part is committed once any one of its conversations is finished", "data_gen/batch_pool.py",
           "running[committed] == 0:", "running[committed] < len(parts[committed]):", POOL),
    Mutant("P2", "no pool across parts: the next part is let in only when nothing is pending (turn-synchronous)",
           "data_gen/batch_pool.py", "while len(pending) < batch_size and admitted", "while not pending and admitted",
           POOL),
    Mutant("P3", "calls take the latest parts' requests first", "data_gen/batch_pool.py",
           "pending.sort(key=lambda r: r[0])", "pending.sort(key=lambda r: -r[0])", POOL),
    Mutant("P4", "SIGTERM is caught but never asked: the run goes on to the end", "data_gen/generate.py",
           "backend.answer, commit, stop.is_set)", "backend.answer, commit, lambda: False)", TERM),
    Mutant("P5", "a stop commits the unfinished conversations too (cut mid-conversation)", "data_gen/batch_pool.py",
           "for conv in p if id(conv) not in waiting]", "for conv in p]", TERM),
    Mutant("P6", "a rerun generates again what committed parts hold (their ids not skipped)", "data_gen/generate.py",
           "todo = [c for c in convs if c.id not in done]", "todo = list(convs)",
           ("tests/test_data_gen_openai.py::test_kill9_at_random_moments_then_rerun_loses_and_duplicates_nothing",)),
    Mutant("A1", "decode attention pairs query head h with KV head h % KVH, not h // G", "core/engine/decode_attention.py",
           "query.reshape(b, kvh, h // kvh, d)", "query.reshape(b, h // kvh, kvh, d).transpose(1, 2)", DECODE_ATTN),
    Mutant("A2", "decode attention ignores the mask", "core/engine/decode_attention.py",
           "key, value, attn_mask=mask,", "key, value, attn_mask=None,", DECODE_ATTN),
    Mutant("A3", "load_target leaves the target on stock SDPA", "core/target/model.py", "    use_decode_attention(model)\n", "",
           DECODE_ATTN),
    Mutant("D1", "backend dataset answers each user turn with the source's answer to the turn before",
           "data_gen/dataset_backend.py", "c.answers[c.answered]", "c.answers[c.answered - 1]",
           (DATASET + "test_rows_hold_the_sharegpt_answers_and_train_only_on_them",)),
    Mutant("D2", "backend dataset cuts an answer inside a character (no step back to whole characters)",
           "data_gen/dataset_backend.py", "            n -= 1  # the cut", "            break  # the cut",
           (DATASET + "test_max_new_tokens_cuts_an_answer_and_flags_it_length",)),
    Mutant("KM1", "the tokenizer loads without the model dir's remote code", "core/target/model.py",
           "        tok = AutoTokenizer.from_pretrained(resolve_target(cfg), local_files_only=True,\n"
           "                                            trust_remote_code=cfg.target.trust_remote_code)",
           "        tok = AutoTokenizer.from_pretrained(resolve_target(cfg), local_files_only=True)", KIMI),
    Mutant("KM2", "the embedding is looked up under Llama's name, not the checkpoint's prefix", "core/target/model.py",
           "    return WeightNames(p, p + embed,", "    return WeightNames(p, embed,", KIMI),
    Mutant("KM3", "a generation prompt that opened <think> is ignored (the thinking lands in content)",
           "data_gen/chat_tokenize.py", "    if prompt_opens:\n", "    if False:\n", KIMI),
    Mutant("KM4", "Kimi's config keeps thinking beside the answer, untrained", "configs/kimi-k2.5.yaml",
           "  reasoning: render ", "  reasoning: field ", KIMI),
    Mutant("KM5", "one-server passes are combined whatever models their servers served", "eval/server_passes.py",
           '    if base["models"] != spec["models"]:', "    if False:",
           ("tests/test_server_eval.py::test_passes_of_two_different_targets_are_not_combined",)),
    Mutant("KM6", "the exported config.json's head_dim is not the one the tensors were built with",
           "core/drafters/drafter_config.py", '"head_dim": self.head_dim}', '"head_dim": 2 * self.head_dim}',
           ("tests/test_target_configs.py::test_full_size_export_loads_in_sglang_with_every_shape",)),
    Mutant("V1", "a stage reads an upstream whose manifest says in progress", "core/storage/manifest.py",
           '    if manifest.get("counts", {}).get("status") == IN_PROGRESS:', "    if False:",
           ("tests/test_run_integrity.py::test_a_stage_refuses_an_upstream_that_has_not_finished",)),
    Mutant("V2", "a conversations part's sha256 is never compared", "core/storage/conversations.py",
           "    if hashlib.sha256(data).hexdigest() != digest.read_text().strip():", "    if False:",
           ("tests/test_run_integrity.py::test_a_damaged_conversations_part_is_one_line_naming_it",)),
    Mutant("V3", "a run killed before its first checkpoint keeps its logged steps (logged twice)", "train/loop.py",
           "        trim_logs(accelerator, logs, 0)", "        pass",
           ("tests/test_resume.py::test_a_run_killed_before_its_first_checkpoint_logs_each_step_once",)),
    Mutant("V4", "eval measures on the training split instead of the held-out one", "core/target/chat.py",
           'load_prompts(cfg.data_gen.prompts, "heldout", cfg.data_gen.heldout_percent)',
           'load_prompts(cfg.data_gen.prompts, "train", cfg.data_gen.heldout_percent)',
           ("tests/test_pipeline.py::test_report_contract",)),
    Mutant("V5", "the lossless check never compares the two outputs", "eval/run.py",
           '"match": base.tokens == out.tokens if t == 0 else None', '"match": True if t == 0 else None',
           ("tests/test_run_integrity.py::test_a_speculative_output_that_differs_by_one_token_makes_the_report_say_no",)),
    Mutant("V6", "train.loss_decay weights the logged loss only, not the gradient", "train/ttt_loss.py",
           "    scales = decay ** torch.arange(steps, device=aux.device) / counts.clamp(min=1)",
           "    scales = 1.0 ** torch.arange(steps, device=aux.device) / counts.clamp(min=1)",
           ("tests/test_drafter.py::test_loss_decay_weights_each_steps_gradient",)),
    Mutant("V7", "gradient clipping switched off", "train/fit.py",
           "norm = accelerator.clip_grad_norm_(f.objective.parameters(), tc.grad_clip)",
           "norm = accelerator.clip_grad_norm_(f.objective.parameters(), float('inf'))",
           ("tests/test_run_integrity.py::test_every_optimizer_step_sees_gradients_clipped_to_grad_clip",)),
    Mutant("V8", "RoPE rotates the other way", "core/drafters/drafter.py", "out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)",
           "out = (x1 * cos + x2 * sin, x2 * cos - x1 * sin)",
           ("tests/test_drafter.py::test_rope_rotates_as_transformers_llama_does",)),
    Mutant("V9", "the two RMSNorms of the attention input swapped", "core/drafters/drafter.py",
           "x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)], -1)",
           "x = torch.cat([layer.hidden_norm(self.embed_tokens(tokens)), layer.input_layernorm(hidden)], -1)",
           ("tests/test_drafter.py::test_each_norm_takes_its_own_input_in_both_qkv_paths",)),
    Mutant("V10", "a full disk reported in a writer's own words (safetensors) stays a traceback", "core/run/cli.py",
           "        if free is None or free > FULL_DISK_BYTES:", "        if True:",
           ("tests/test_run_integrity.py::test_a_disk_that_fills_while_training_writes_is_one_line",)),
    Mutant("V11", "extract reads conversations/ while data_gen still writes it (no reader lock)", "extract/run.py",
           'stage_reader(cfg.run_path / "conversations", "extract"), ', "",
           ("tests/test_run_integrity.py::test_a_stage_does_not_read_what_its_upstream_is_still_writing",)),
    Mutant("V12", "`extract --fresh` deletes the shards a running train reads (train takes no reader lock)",
           "train/loop.py", 'with stage_reader(data, "train"), ', "with ",
           ("tests/test_run_integrity.py::test_a_second_train_in_the_same_run_dir_fails_at_once_naming_the_first",)),
    Mutant("B6", "fc_norm normalises the concatenated aux instead of each chunk", "core/drafters/drafter.py",
           "            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, -1), strict=True)], -1)",
           "            aux = aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + 1e-5) * "
           "torch.cat([n.weight for n in self.fc_norm])", NORM_FC),
    Mutant("B7", "norm_output ignored: every next step reads h2", "core/drafters/drafter.py",
           "        return normed if self.config.norm_output else h2", "        return h2", NORM_FC),
    Mutant("B8", "decoding ignores norm_output while training honours it", "core/drafters/drafter.py",
           "        return self.lm_head(normed), self.next_input(h2, normed)", "        return self.lm_head(normed), h2",
           ("tests/test_draft_alignment.py::test_ttt_step_outputs_equal_decode_time_drafts",)),
    Mutant("B9", "llama.cpp's export converts a drafter whose fc_norm / norm_output its converter ignores",
           "eval/llamacpp.py", "    if ignored:", "    if False:", NORM_FC),
    Mutant("L1", "the MLA layer's attention input concatenated [hidden, embed] instead of [embed, hidden]",
           "core/drafters/drafter.py",
           "x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)], -1)",
           "x = torch.cat([layer.hidden_norm(hidden), layer.input_layernorm(self.embed_tokens(tokens))], -1)", MLA),
    Mutant("L2", "RoPE applied to the query's nope part instead of its rope part", "core/drafters/drafter.py",
           "q = torch.cat([q_nope, apply_rope(q_pe, positions, theta, interleaved=True)], -1)",
           "q = torch.cat([apply_rope(q_nope, positions, theta, interleaved=True), q_pe], -1)", MLA),
    Mutant("L3", "the shared RoPE key rotated Llama's way (halves) instead of DeepSeek's interleaved pairs",
           "core/drafters/drafter.py", "k_pe = apply_rope(k_pe[:, None], positions, theta, interleaved=True)",
           "k_pe = apply_rope(k_pe[:, None], positions, theta)", MLA),
    Mutant("L4", "the KV latent not normalised before kv_b_proj", "core/drafters/drafter.py",
           "kv = self.kv_b_proj(self.kv_a_layernorm(latent))", "kv = self.kv_b_proj(latent)", MLA),
    Mutant("L5", "the MLA config.json's model_type is not SGLang's registered kimi_k2", "core/drafters/drafter_config.py",
           '"model_type": "kimi_k2"', '"model_type": "deepseek_v2"', MLA),
    Mutant("L6", "llama.cpp's export converts an MLA drafter its converter reads as Llama", "eval/llamacpp.py",
           '    if config.get("architectures") != [GQA_ARCHITECTURE]:', "    if False:", MLA),
    Mutant("L7", "the plan's MLA KV cache leaves out the shared RoPE key", "core/run/plan.py",
           "    return 2 * (kv_lora_rank + rope_dim) * layers", "    return 2 * kv_lora_rank * layers",
           ("tests/test_kimi_plan.py::test_kimi_plan_prints_disk_memory_and_the_hand_patched_run",)),
    Mutant("L8", "the planned MLA parameter count leaves out kv_b_proj", "core/run/plan.py",
           "                     + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * h)",
           "                     + nh * m.v_head_dim * h)",
           ("tests/test_target_configs.py::test_planned_parameter_counts_are_the_drafters",)),
    Mutant("L9", "the merged (cuDNN) TTT attention keeps the kernel's zero-padded output columns of an MLA v",
           "train/ttt_attention.py", "        out0 = out0[..., :values[0].shape[-1]]\n", "",
           ("tests/test_ttt_fast_paths.py::test_merged_attention_checks_itself_against_the_dense_path_and_names_what_is_off",)),
    Mutant("Z1", "a DeepSpeed launch on a CPU silently trains as plain MULTI_CPU", "train/loop.py",
           "cpu=not torch.cuda.is_available() and not deepspeed,", "cpu=not torch.cuda.is_available(),",
           (DS + "::test_zero3_takes_the_plain_step_at_the_runs_clip",)),
    Mutant("Z2", "DeepSpeed's CPU ranks start with no backend: each counts itself alone", "train/loop.py",
           '        PartialState(cpu=False, backend="gloo")', "        pass",
           (DS + "::test_two_processes_stopped_at_a_checkpoint_and_rerun_end_where_the_uninterrupted_run_ends",)),
    Mutant("Z3", "train.grad_clip never reaches DeepSpeed's clip", "train/deepspeed_config.py",
           '    ours = {"gradient_clipping": (tc.grad_clip, "train.grad_clip"),',
           '    ours = {"gradient_clipping": (1e9, "train.grad_clip"),',
           (DS + "::test_zero3_takes_the_plain_step_at_the_runs_clip",)),
    Mutant("Z4", "ZeRO-3 leaves the weights a compiled step reads outside their modules partitioned", "train/deepspeed_config.py",
           "        deepspeed.zero.register_external_parameter(objective, proj.weight)", "        pass",
           (DS + "::test_zero3_gathers_what_a_compiled_step_reads_and_keeps_the_online_target_whole",)),
    Mutant("Z5", "ZeRO-3 exports the rank's partition instead of the gathered weights", "train/deepspeed_config.py",
           "    state = accelerator.get_state_dict(objective)\n", "    return None\n",
           (DS + "::test_kill_9_under_zero3_then_rerun_ends_at_the_uninterrupted_weights",)),
    Mutant("Z6", "online training under ZeRO-3 builds the frozen target split over the ranks", "train/deepspeed_config.py",
           "    hf_deepspeed._hf_deepspeed_config_weak_ref = None\n", "",
           (DS + "::test_zero3_gathers_what_a_compiled_step_reads_and_keeps_the_online_target_whole",)),
    Mutant("Z7", "a CPU DeepSpeed launch JIT-builds the shared-memory all-reduce it never calls", "train/loop.py",
           "        skip_shm_comm_build()", "        pass",
           (DS + "::test_zero3_takes_the_plain_step_at_the_runs_clip",)),
    Mutant("V13", "each TTT step reads the previous step's hidden state detached (no gradient between steps)",
           "train/ttt_loss.py", "        hidden = drafter.next_input(hidden, normed)",
           "        hidden = drafter.next_input(hidden, normed).detach()",
           ("tests/test_drafter.py::test_ttt_gradient_equals_the_numerical_derivative",)),
    Mutant("VX1", "vLLM's layer ids shifted by one (the SGLang Llama convention, id = output of layer i)",
           "core/target/vllm_extract.py", "    return [*aux_layers, num_layers]", "    return [*(i - 1 for i in aux_layers), num_layers]",
           (VX + "::test_shards_equal_the_hf_engines_and_each_fault_is_named_not_written",
            VX + "::test_vllm_layer_ids_capture_our_aux_layers_and_final_on_llama")),
    Mutant("VX2", "the vllm engine never compares the file's token ids (the sample's own are passed on as seen)",
           "extract/vllm_client.py", "        return ids, aux, final_norm(hs[:, -1], self.norm_weight, self.norm_eps)",
           "        return torch.tensor(input_ids), aux, final_norm(hs[:, -1], self.norm_weight, self.norm_eps)",
           (VX + "::test_shards_equal_the_hf_engines_and_each_fault_is_named_not_written",)),
    Mutant("VX3", "the vllm engine reads a file before its writer released the lock", "extract/vllm_client.py",
           "                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n                    break",
           "                    break", (VX + "::test_shards_equal_the_hf_engines_and_each_fault_is_named_not_written",)),
    Mutant("DF1", "a DFlash training block sees its anchor's own context row (the engine has not run it yet)",
           "train/dflash_loss.py", "ctx = torch.arange(context, device=anchors.device) < anchors[..., owner, None]",
           "ctx = torch.arange(context, device=anchors.device) <= anchors[..., owner, None]",
           (DFL + "::test_training_computes_the_block_the_engine_drafts",)),
    Mutant("DF2", "the DFlash export leaves training's aux preconditioner out of fc", "core/drafters/dflash.py",
           '        sd["fc.weight"] = sd["fc.weight"] / self.aux_scale.cpu()\n', "",
           (DFL + "::test_the_export_is_what_the_engine_loads",)),
    Mutant("DF3", "the DFlash export writes our input-of-layer ids as its output-of-layer target_layer_ids",
           "core/drafters/dflash.py", '"target_layer_ids": [k - 1 for k in self.aux_layers]',
           '"target_layer_ids": list(self.aux_layers)', (DFL + "::test_the_export_is_what_the_engine_loads",)),
    Mutant("DF4", "the DFlash engine drafts from a block one position late", "core/drafters/dflash.py",
           "    positions = torch.arange(ctx.length, ctx.length + steps + 1, device=device)[None]",
           "    positions = torch.arange(ctx.length + 1, ctx.length + steps + 2, device=device)[None]",
           (DFL + "::test_training_computes_the_block_the_engine_drafts",)),
    Mutant("DF5", "the DFlash export leaves out hidden_norm (SGLang keeps its init without a word)", "core/drafters/dflash.py",
           'for k, v in self.state_dict().items() if k != "aux_scale"}',
           'for k, v in self.state_dict().items() if k != "aux_scale" and "hidden_norm" not in k}',
           (DFL + "::test_sglang_loads_the_export_whole_and_captures_the_trained_layers",)),
    Mutant("DF6", "DFlash's batched loss counts the padding blocks of a sample with fewer anchors", "train/dflash_loss.py",
           "counted = real[..., None] & (target < t)", "counted = (target < t)",
           (DFL + "::test_a_batch_trains_what_its_samples_train_alone",)),
    Mutant("VL1", "the speculators export leaves out the aux layer ids (vLLM captures its default layers)",
           "core/drafters/drafter_config.py", '            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),  # vLLM',
           "            # vLLM", (VLLM,)),
    Mutant("VL2", "the speculators export writes the aux ids shifted by one (SGLang's Llama convention)",
           "core/drafters/drafter_config.py", '"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),  # vLLM',
           '"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers],  # vLLM', (VLLM,)),
    Mutant("VL3", "the speculators export drops norm_output", "core/drafters/drafter_config.py",
           '            "norm_output": self.norm_output,\n', "", (VLLM,)),
    Mutant("VL4", "the speculators export leaves norm_before_residual to vLLM's default (true)",
           "core/drafters/drafter_config.py", '"norm_before_residual": False, ', "", (VLLM,)),
    Mutant("LK1", "alpha multiplies p and q instead of taking their minimum", "train/draft_head_loss.py",
           "alpha = torch.minimum(pc * mass[:, None], q).sum(-1)", "alpha = (pc * mass[:, None] * q).sum(-1)",
           (LKT,)),
    Mutant("LK2", "alpha over the renormalised draft-vocab p (the target's mass outside the draft vocab accepted)",
           "train/draft_head_loss.py", "alpha = torch.minimum(pc * mass[:, None], q).sum(-1)",
           "alpha = torch.minimum(pc, q).sum(-1)", (LKT,)),
    Mutant("LK3", "lk_lambda's KL weight not detached from alpha", "train/draft_head_loss.py",
           "torch.exp(-loss.kl_decay * alpha.detach())", "torch.exp(-loss.kl_decay * alpha)", (LKT,)),
    Mutant("LK4", "the chunked LK gradient forgets the softmax's own term (d alpha / dz = q * u)", "train/draft_head_loss.py",
           "d_alpha = q * (under.float() - (q * under).sum(-1, keepdim=True))", "d_alpha = q * under.float()", (LKT,)),
    Mutant("LK5", "the teacher's draft-vocab mass is never computed (alpha over the renormalised p in training)",
           "train/ttt_loss.py", "    if lse is not None:\n        mass[rows]", "    if False:\n        mass[rows]",
           ("tests/test_lk_loss.py::test_training_alpha_counts_the_mass_outside_a_pruned_draft_vocab",)),
]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def pytest(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=tree, capture_output=True, text=True, env=env)
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    return proc.returncode, (failed or last)[0][:160]


def run_mutant(m: Mutant) -> tuple[bool, int, str, float]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        path = tree / m.file
        try:
            path.write_text(m.apply(path.read_text()))
        except ValueError as e:
            raise SystemExit(str(e)) from None
        t = time.time()
        rc, detail = pytest(tree, m.tests)
        return rc == 1, rc, detail, time.time() - t


def aim_problems(mutants: list[Mutant]) -> list[str]:
    """What keeps a mutant from checking anything: a replacement that no longer matches its file once (the code
    moved on), a test that does not exist, a name used twice."""
    problems = [f"{name}: name used twice" for name in {m.name for m in mutants}
                if sum(m.name == name for m in mutants) > 1]
    for m in mutants:
        try:
            m.apply((ROOT / m.file).read_text())
        except (OSError, ValueError) as e:
            problems.append(str(e))
        for test in m.tests:
            path, _, name = test.partition("::")
            if not (ROOT / path).is_file():
                problems.append(f"{m.name}: no {path}")
            elif name and f"def {name.split('[')[0]}(" not in (ROOT / path).read_text():
                problems.append(f"{m.name}: no {test}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    ap.add_argument("--check", action="store_true", help="check that every mutant still applies (its replacement "
                    "matches its file exactly once), names tests that exist and has a name of its own; run nothing")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.check:
        problems = aim_problems(chosen)
        print("\n".join(problems) or f"{len(chosen)} mutants aimed at their code")
        return 1 if problems else 0
    if args.list:
        for m in chosen:
            print(f"{m.name:4} {m.file:26} {m.what}  <- {' '.join(m.tests)}")
        return 0
    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
            copy_tree(Path(tmp))
            rc, detail = pytest(Path(tmp), tests)
        print(f"baseline (no mutation): pytest exit {rc}: {detail}", flush=True)
        if rc != 0:
            print("the unmutated tests must pass first", file=sys.stderr)
            return 2
    print("| mutant | what | tests | result | pytest says |\n|---|---|---|---|---|", flush=True)
    survivors = []
    for m in chosen:
        killed, rc, detail, secs = run_mutant(m)
        if not killed:
            survivors.append(m.name)
        verdict = "killed" if killed else f"SURVIVED (exit {rc})"
        tests = ", ".join(t.replace("tests/", "") for t in m.tests)
        print(f"| {m.name} | {m.what} | {tests} | {verdict} ({secs:.0f} s) | {detail.replace('|', '/')} |", flush=True)
    print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
