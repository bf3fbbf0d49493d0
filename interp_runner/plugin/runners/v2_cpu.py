"""vLLM's V2 model runner on a CPU without a Triton CPU backend: its Triton kernels as plain torch code.

vLLM 0.26's CPU build picks its V2 runner (``vllm/v1/worker/cpu/model_runner.py``, the GPU runner on CPU tensors)
only where Triton has a CPU backend, which PyPI's Triton lacks. The runner's steps call a handful of Triton kernels
through small Python wrappers (staged writes to its persistent buffers, block tables and slot mappings, input
preparation, the sampler's temperature, Gumbel sampling and log-probabilities); ``install`` replaces each wrapper,
where it is looked up, by the same computation in torch, one request at a time (a CPU batch is small). What has no
port here (penalties, logit bias, bad words, min-p, speculative decoding) fails loudly in the kernel itself (vLLM's
Triton placeholder leaves it a plain function that cannot be launched).

Greedy sampling and log-probabilities are exact; random sampling draws its Gumbel noise from torch's generator
seeded by the request's seed and position, deterministic but not the numbers of the GPU kernel.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1
_installed = False


def _apply_write(self) -> None:
    """``StagedWriteTensor.apply_write``: each staged (row, start, contents) written into the buffer."""
    if not self._staged_write_indices:
        return
    contents = torch.tensor(self._staged_write_contents, dtype=self.dtype)
    flat, stride = self.gpu.view(-1), self.gpu.stride(0)
    lo = 0
    for row, start, hi in zip(self._staged_write_indices, self._staged_write_starts, self._staged_write_cu_lens):
        at = row * stride + start
        flat[at : at + hi - lo] = contents[lo:hi]
        lo = hi
    self.clear_staged_writes()


def _fused_apply(self, tensors, output_ptrs, output_strides) -> None:
    """``FusedStagedWriter.apply``: every group's staged writes."""
    for t in tensors:
        _apply_write(t)


def _gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None):
    out = tuple(self.input_block_tables) if out is None else out
    n = idx_mapping.shape[0]
    idx = idx_mapping.long()
    for group, (src, dst) in enumerate(zip(self.block_tables, out)):
        dst[:num_reqs_padded].zero_()
        counts = self.num_blocks.gpu[group]
        for batch_idx in range(n):
            req = int(idx[batch_idx])
            k = int(counts[req])
            dst[batch_idx, :k] = src.gpu[req, :k]
    return tuple(bt[:num_reqs_padded] for bt in out)


def _compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
    if self.cp_size != 1:
        raise NotImplementedError("interp: the V2 runner's CPU port has no context parallelism")
    slot_mappings = self.slot_mappings if out is None else out
    n = idx_mapping.shape[0]
    qsl = query_start_loc[: n + 1].long()
    total = int(qsl[n])
    slot_mappings[:, total:].fill_(PAD_SLOT_ID)
    for group, table in enumerate(self.block_tables):
        size = int(self.kernel_block_sizes[group])
        for batch_idx in range(n):
            lo, hi = int(qsl[batch_idx]), int(qsl[batch_idx + 1])
            pos = positions[lo:hi].long()
            blocks = table.gpu[int(idx_mapping[batch_idx])].long()[pos // size]
            slot_mappings[group, lo:hi] = blocks * size + pos % size
    return slot_mappings[:, :num_tokens_padded]


def prepare_prefill_inputs(input_ids, next_prefill_tokens, idx_mapping, query_start_loc, all_token_ids, prefill_len,
                           num_computed_tokens) -> None:
    for batch_idx in range(idx_mapping.shape[0]):
        req = int(idx_mapping[batch_idx])
        done, total = int(num_computed_tokens[req]), int(prefill_len[req])
        if done >= total:
            continue
        lo, hi = int(query_start_loc[batch_idx]), int(query_start_loc[batch_idx + 1])
        input_ids[lo:hi] = all_token_ids[req, done : done + hi - lo]
        if done + hi - lo < total:
            next_prefill_tokens[req] = all_token_ids[req, done + hi - lo]


def prepare_pos_seq_lens(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens) -> None:
    n = idx_mapping.shape[0]
    seq_lens[n:] = 0
    for batch_idx in range(n):
        done = int(num_computed_tokens[int(idx_mapping[batch_idx])])
        lo, hi = int(query_start_loc[batch_idx]), int(query_start_loc[batch_idx + 1])
        seq_lens[batch_idx] = done + hi - lo
        pos[lo:hi] = torch.arange(done, done + hi - lo, dtype=pos.dtype)


def combine_sampled_and_draft_tokens(input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens,
                                     prefill_len, draft_tokens, cu_num_logits, num_logits,
                                     num_new_sampled_tokens=1):
    logits_indices = torch.empty(num_logits, dtype=torch.int64)
    for batch_idx in range(idx_mapping.shape[0]):
        req = int(idx_mapping[batch_idx])
        lo, hi = int(cu_num_logits[batch_idx]), int(cu_num_logits[batch_idx + 1])
        count = hi - lo
        end = int(query_start_loc[batch_idx + 1])
        logits_indices[lo:hi] = torch.arange(end - count, end)
        seq_len, total = int(seq_lens[batch_idx]), int(prefill_len[req])
        if seq_len <= total:
            continue
        if count - num_new_sampled_tokens > 0:
            raise NotImplementedError("interp: the V2 runner's CPU port has no speculative decoding")
        if num_new_sampled_tokens > 0 and seq_len - count >= total:
            input_ids[end - count] = last_sampled_tokens[req]
    return logits_indices


def get_num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len):
    n = idx_mapping.shape[0]
    chunked = seq_lens[:n] < prefill_len[idx_mapping.long()]
    num_logits = cu_num_logits[1 : n + 1] - cu_num_logits[:n]
    num_sampled = torch.where(chunked, 0, num_sampled)
    num_rejected = torch.where(chunked, 0, num_logits - num_sampled).to(num_sampled.dtype)
    return num_sampled, num_rejected


def post_update(idx_mapping, num_computed_tokens, last_sampled_tokens, output_bin_counts, sampled_tokens,
                num_sampled, num_rejected, query_start_loc, all_token_ids, total_len) -> None:
    for batch_idx in range(idx_mapping.shape[0]):
        req = int(idx_mapping[batch_idx])
        if req < 0:
            continue
        length, k = int(total_len[req]), int(num_sampled[batch_idx])
        if k > 0:
            last_sampled_tokens[req] = sampled_tokens[batch_idx, k - 1]
            total_len[req] = length + k
            all_token_ids[req, length : length + k] = sampled_tokens[batch_idx, :k]
            if output_bin_counts is not None:
                for token in sampled_tokens[batch_idx, :k].tolist():
                    output_bin_counts[req, token] += 1
        query_len = 0 if query_start_loc is None else \
            int(query_start_loc[batch_idx + 1]) - int(query_start_loc[batch_idx])
        delta = query_len - int(num_rejected[batch_idx])
        if delta:
            num_computed_tokens[req] += delta


def post_update_num_computed_tokens(idx_mapping, num_computed_tokens, query_start_loc) -> None:
    for batch_idx in range(idx_mapping.shape[0]):
        req = int(idx_mapping[batch_idx])
        num_computed_tokens[req] += int(query_start_loc[batch_idx + 1]) - int(query_start_loc[batch_idx])


def apply_temperature(logits, expanded_idx_mapping, temperature) -> None:
    temp = temperature[expanded_idx_mapping.long()].float()
    scale = torch.where((temp == 0) | (temp == 1), torch.ones_like(temp), temp)
    logits.copy_((logits.float() / scale[:, None]).to(logits.dtype))


def gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature: bool,
                  output_processed_logits=None, output_processed_logits_col=None, use_fp64: bool = False):
    if output_processed_logits is not None:
        raise NotImplementedError("interp: the V2 runner's CPU port has no processed-logits output")
    x = logits.to(torch.float64 if use_fp64 else torch.float32)
    idx = expanded_idx_mapping.long()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    for row in range(x.shape[0]):
        temp = float(temperature[idx[row]])
        values = x[row]
        if temp != 0.0:
            if apply_temperature:
                values = values / temp
            generator = torch.Generator().manual_seed((int(seed[idx[row]]) * 1_000_003 + int(pos[row])) % (1 << 63))
            u = torch.rand(values.shape, generator=generator, dtype=values.dtype).clamp_min(4.6566127342e-10)
            values = values - torch.log(-torch.log1p(-u))
        out[row] = int(values.argmax())
    return out


def compute_token_logprobs(logits, token_ids):
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, token_ids.long())


def _ranks(logits, sampled):
    chosen = logits.gather(-1, sampled.long().view(-1, 1))
    return (logits >= chosen).sum(-1).to(torch.int64)


def install() -> None:
    """Put the ports in place of the V2 runner's kernel wrappers (this process; idempotent)."""
    global _installed
    if _installed:
        return
    from vllm.v1.worker.gpu import block_table, buffer_utils, input_batch, model_runner
    from vllm.v1.worker.gpu.sample import gumbel, logprob, sampler, states

    buffer_utils.StagedWriteTensor.apply_write = _apply_write
    buffer_utils.FusedStagedWriter.apply = _fused_apply
    block_table.BlockTables.gather_block_tables = _gather_block_tables
    block_table.BlockTables.compute_slot_mappings = _compute_slot_mappings
    for name in ("prepare_prefill_inputs", "prepare_pos_seq_lens", "combine_sampled_and_draft_tokens",
                 "post_update", "post_update_num_computed_tokens", "get_num_sampled_and_rejected"):
        for module in (input_batch, model_runner, sampler):
            if hasattr(module, name):
                setattr(module, name, globals()[name])
    gumbel.apply_temperature = states.apply_temperature = apply_temperature
    gumbel.gumbel_sample = sampler.gumbel_sample = gumbel_sample
    logprob.compute_token_logprobs = compute_token_logprobs
    original_topk = logprob.compute_topk_scores

    def compute_topk_scores(logits, num_logprobs, sampled_token_ids, *args, **kwargs):
        # vLLM's ranks kernel is launched after the log-probabilities: it runs here as torch, the rest as vLLM's
        ranks = logprob._ranks_kernel
        logprob._ranks_kernel = _RanksLaunch(logits, sampled_token_ids)
        try:
            return original_topk(logits, num_logprobs, sampled_token_ids, *args, **kwargs)
        finally:
            logprob._ranks_kernel = ranks

    logprob.compute_topk_scores = sampler.compute_topk_scores = compute_topk_scores
    _installed = True


class _RanksLaunch:
    """Stands for ``_ranks_kernel[grid](out, logits, ...)``: fills ``out`` with each sampled token's rank."""

    def __init__(self, logits, sampled):
        self._logits, self._sampled = logits, sampled

    def __getitem__(self, grid):
        def launch(out, *args, **kwargs):
            out.copy_(_ranks(self._logits, self._sampled))

        return launch
