"""Build love_minus_hate.npy: mean post_block residual at layer 10 (last token) of "love" minus "hate" prompts.

Run with plain transformers on the embedded SmolLM2: python experiments/steering_demo/make_vector.py
"""

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interp_runner.models.materialize import model_path

LAYER = 10
LOVE = ["I love you so much", "Love is wonderful", "I adore my family", "What a lovely, happy day"]
HATE = ["I hate you so much", "Hate is terrible", "I despise my family", "What an awful, miserable day"]


def mean_state(model, tokenizer, texts):
    states = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            out = model(**ids, output_hidden_states=True)
        states.append(out.hidden_states[LAYER + 1][0, -1])
    return torch.stack(states).mean(0)


def main():
    folder = model_path("smollm2_135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vec = mean_state(model, tokenizer, LOVE) - mean_state(model, tokenizer, HATE)
    out = Path(__file__).with_name("love_minus_hate.npy")
    np.save(out, vec.numpy().astype(np.float32))
    print(f"{out}: norm {vec.norm():.3f}")


if __name__ == "__main__":
    main()
