"""The HF baseline of ``trace_grid.py``: causal tracing by hand, in batches, with forward hooks on a plain
transformers Llama (the embeddings' subject tokens noised, each cell's clean hidden state restored at its layer and
token)."""

from __future__ import annotations

import time


class HFTrace:
    """Hand-batched causal tracing with forward hooks on a plain transformers Llama."""

    def __init__(self, model, token_ids, subject, noise, answer: int, batch: int, device: str):
        import torch

        self.torch, self.model, self.device = torch, model, device
        self.ids = torch.tensor([token_ids], device=device)
        self.n = len(token_ids)
        self.subject = torch.tensor(subject, device=device)
        self.noise = torch.as_tensor(noise, device=device).to(model.dtype)  # [subject tokens, hidden]
        self.answer = answer
        layers = model.model.layers
        self.num_layers = len(layers)
        # rows: one corrupted baseline (layer -1), then every cell
        cells = [(-1, -1)] + [(lay, t) for lay in range(self.num_layers) for t in range(self.n)]
        self.batches = []
        for start in range(0, len(cells), batch):
            chunk = cells[start : start + batch]
            per_layer = {}
            for lay in range(self.num_layers):
                rows = [i for i, (cl, _) in enumerate(chunk) if cl == lay]
                if rows:
                    toks = [chunk[i][1] for i in rows]
                    per_layer[lay] = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
            self.batches.append((len(chunk), per_layer))
        self.mode = None  # "clean" | "cells"
        self.restore = {}
        self.clean = None  # [layers, tokens, hidden]
        self._captured = [None] * self.num_layers
        self.handles = [model.model.embed_tokens.register_forward_hook(self._embed)]
        self.handles += [layer.register_forward_hook(self._layer_hook(i)) for i, layer in enumerate(layers)]

    def _embed(self, module, inputs, out):
        if self.mode == "cells":
            out[:, self.subject] += self.noise
        return out

    def _layer_hook(self, index: int):
        def hook(module, inputs, out):
            h = out[0] if isinstance(out, tuple) else out
            if self.mode == "clean":
                self._captured[index] = h[0].detach().clone()
            elif index in self.restore:
                rows, toks = self.restore[index]
                h[rows, toks] = self.clean[index, toks]
            return out

        return hook

    def _answer_logprob(self, rows: int):
        torch = self.torch
        hidden = self.model.model(input_ids=self.ids.expand(rows, -1), use_cache=False).last_hidden_state
        logits = self.model.lm_head(hidden[:, -1]).float()
        return torch.log_softmax(logits, dim=-1)[:, self.answer]

    def grid(self):
        """(seconds, [layers, tokens] restored log-probs, clean log-prob, corrupt log-prob)."""
        torch = self.torch
        self._sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.mode = "clean"
            clean_lp = self._answer_logprob(1)
            self.clean = torch.stack(self._captured)
            self.mode = "cells"
            out = []
            for rows, per_layer in self.batches:
                self.restore = per_layer
                out.append(self._answer_logprob(rows))
            lps = torch.cat(out).cpu()
            clean_lp = float(clean_lp.cpu()[0])
        self._sync()
        dt = time.perf_counter() - t0
        self.mode, self.restore = None, {}
        return dt, lps[1:].view(self.num_layers, self.n).double().numpy(), clean_lp, float(lps[0])

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()
