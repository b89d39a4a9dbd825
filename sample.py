"""
Generates from a checkpoint of train.py, or evaluates it.

    python sample.py --out-dir out/tiny-lime                          # random test expressions, solved
    python sample.py --out-dir out/tiny-lime --start "( 7 + 5 ) / 3"   # your own expression
    python sample.py --out-dir out/tiny-lime --eval                   # accuracy per tier
    python sample.py --out-dir out/150m-lime --start "The meaning of" --num-samples 3
    python sample.py --out-dir out/150m-lime --eval                   # validation perplexity
    python sample.py --out-dir out/prosqa-lime --num-samples 2        # random ProsQA test questions, answered
    python sample.py --out-dir out/prosqa-lime --eval                 # ProsQA test accuracy

The model is rebuilt from the config saved in the checkpoint: no model flags to repeat.
Language and ProsQA checkpoints decode with the GPT-2 tokenizer, arithmetic ones with the
task vocabulary. Generation uses the KV cache.
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (DEVICES, SEED, DataError, Parser, UsageError, a_path, autocast_for, check_a_file, one_line_errors,
                 pick_device, show_metrics, synchronize)

import math
import random
import re
import time
from pathlib import Path

import torch

import arithmetic
import prosqa
import runs
from data import decode_tokens, evaluate, gpt2_encoding
from generation import generate


class Codec:
    """Text <-> token ids for a checkpoint: GPT-2 for language and ProsQA, the task vocabulary for
    arithmetic. `stop` ends a generation: the end of a task's sample (None for language)."""

    def __init__(self, cfg):
        self.arithmetic, self.prosqa = cfg.data == "arithmetic", cfg.data == "prosqa"
        if self.arithmetic or self.prosqa:  # (a file there: not "no data, make it", which prepare_data.py refuses)
            runs.check_data_dir(cfg)
        if self.arithmetic:
            self.vocab, self.splits, self.task, self.meta = arithmetic.load(cfg.data_dir, cfg.task)
            self.stop, self.data_dir = self.vocab.eos, Path(cfg.data_dir)
        else:
            self.enc = gpt2_encoding()
            self.stop = self.enc.eot_token if self.prosqa else None
        if self.prosqa:  # test question -> its answer, for a verdict
            test = prosqa.check(Path(cfg.data_dir) / "prosqa_test.json")
            self.answers = {r["question"].strip(): r["answer"] for r in test}

    def encode(self, text):
        if self.arithmetic:
            # tokens as the task writes them, spaced: '(7+5)/3' reads as '( 7 + 5 ) / 3', not as one odd "number"
            typed = text.strip().removesuffix("=").strip()
            text = " ".join(re.findall(r"\d+|<eos>|\S", typed))
            try:  # a clear error for anything that is not a task expression
                self.task.parse(text)
                return self.vocab.encode(text + " =")
            except DataError as e:  # it quotes the spaced text: what was typed too, where that differs ('hello')
                typed = f" (the task's spacing of {typed[:200]!r}{'...' * (len(typed) > 200)})" * (typed != text)
                raise UsageError(f"--start: {e}{typed}") from None
        if self.prosqa:  # the prompt as in training: end-of-text, the question, a newline
            return [self.stop] + self.enc.encode_ordinary(prosqa.texts(
                dict(question=text.strip(), steps=[], answer=""))[0])
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, ids):
        return self.vocab.decode(ids) if self.arithmetic else decode_tokens(self.enc, ids)

    def test_prompt(self, tier, i):
        """The prompt of line i of the arithmetic test split of `tier`: a damaged line is a DataError naming it."""
        line = self.splits[f"test_{tier}"][i]
        try:
            prompt = arithmetic.split_sample(line)[0]
            self.task.parse(prompt.removesuffix("=").strip())
        except (DataError, ValueError) as e:
            raise arithmetic.damaged_line(self.data_dir / f"test_{tier}.txt", i, e, self.meta) from None
        return prompt


def prompts(args, codec, n):
    """The prompt texts: --start (text or FILE:path), else random test expressions or questions, or <|endoftext|>."""
    if args.start is None and codec.arithmetic:
        rng = random.Random(args.seed)
        tests = [(k, i) for k in codec.task.tiers for i in range(len(codec.splits[f"test_{k}"]))]
        return [codec.test_prompt(k, i) for k, i in rng.sample(tests, min(n, len(tests)))]
    if args.start is None and codec.prosqa:
        return random.Random(args.seed).sample(list(codec.answers), min(n, len(codec.answers)))
    text = "<|endoftext|>" if args.start is None else args.start
    if text.startswith("FILE:"):
        check_a_file(text[5:])  # NOTE not a FIFO (its read would wait for a writer forever), nor /dev/zero (endless)
        try:
            text = Path(text[5:]).read_text(encoding="utf-8")
        except OSError as e:  # a file the command reads: exit 1, as for any other
            raise DataError(f"--start {args.start}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise DataError(f"--start {args.start}: not UTF-8 text") from None
    if not text.strip():
        raise UsageError("--start is empty: give some text (or leave it out)")
    return (text for _ in range(1 if args.temperature == 0 else n))  # greedy: n samples would be n copies of one


def samples(model, codec, args, device, autocast):
    block_size, first = model.config.block_size, True  # (the first call pays one-time costs: lazy init, kernel choice)
    for text in prompts(args, codec, args.num_samples):
        ids = codec.encode(text)
        if max(ids) >= model.config.vocab_size:
            raise UsageError(f"token {max(ids)} is outside the model's vocabulary of {model.config.vocab_size}")
        if len(ids) >= block_size:
            raise UsageError(f"the prompt is {len(ids)} tokens; the model's block size is {block_size}")
        max_new = min(args.max_new_tokens, block_size - len(ids))
        if codec.arithmetic and codec.task.target == "answer":
            max_new = 1  # trained on the one answer token alone: what follows it was never learned
        idx = torch.tensor([ids], device=device)
        t = time.time()
        with autocast:
            out = generate(model, idx, max_new, temperature=args.temperature, top_k=args.top_k, stop=codec.stop)
        synchronize(device)
        new = out[0, len(ids):].tolist()
        speed = f"{len(new) / (time.time() - t):,.0f} tokens/s" + (", with the one-time warm-up" if first else "")
        first = False
        if codec.arithmetic:
            solution = codec.decode(new).split("<eos>")[0].strip()
            got = arithmetic.final_answer(solution)
            answer = codec.task.evaluate(codec.task.parse(codec.decode(ids[:-1])))
            verdict = "right" if got == answer else f"wrong, the answer is {answer}"
            print(f"{codec.decode(ids)} {solution}   [{verdict}] ({speed})")
        elif codec.prosqa:
            completion = codec.decode(new[: new.index(codec.stop)] if codec.stop in new else new)
            answer = codec.answers.get(text.strip())
            verdict = "not a test question" if answer is None else \
                "right" if prosqa.correct(completion, answer) else f"wrong, the answer is {answer!r}"
            print(f"{text.strip()}\n{completion}\n--- [{verdict}] ({speed})")
        else:
            print(f"{codec.decode(ids)}{codec.decode(new)}\n--- {len(new)} tokens, {speed}")
        yield ids + new


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--out-dir", type=a_path, required=True, help="run folder holding ckpt.pt (from train.py)")
    p.add_argument("--start", help="prompt text, or FILE:path to read it from a file "
                                   "(default: random test expressions or questions, or <|endoftext|>)")
    p.add_argument("--num-samples", type=int, default=3,
                   help="how many samples to generate (one for a prompt decoded greedily: they would be the same)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate per sample at most (and no further than the model's block size)")
    p.add_argument("--temperature", type=float, help="sampling temperature, 0 = greedy "
                                                     "(default: 0 for arithmetic and prosqa, 0.8 for language)")
    p.add_argument("--top-k", type=int, help="sample only from the k >= 1 most likely tokens "
                                             "(default: 200 for language)")
    p.add_argument("--seed", type=int, default=1337, help="random seed for sampling and for picking expressions")
    p.add_argument("--device", default="auto", help=DEVICES)
    p.add_argument("--data-dir", **runs.DATA_DIR)
    p.add_argument("--eval", action="store_true", help="evaluate instead: validation loss and perplexity, and "
                                                       "accuracy per tier (arithmetic) or on the test "
                                                       "questions (prosqa)")
    with one_line_errors("sample.py"):
        args = p.parse_args(argv)
        given = p.given(argv)
        generation = [k for k in ("start", "num_samples", "max_new_tokens", "temperature", "top_k", "seed")
                      if k in given]  # flags that --eval would ignore
        if args.eval and generation:
            raise UsageError("--eval scores the run on its fixed evaluation sets, without sampling: not with "
                             + ", ".join("--" + k.replace("_", "-") for k in generation))
        if args.num_samples < 1 or args.max_new_tokens < 1:
            raise UsageError("--num-samples and --max-new-tokens must be positive")
        if args.temperature is not None and not 0 <= args.temperature < math.inf:  # (inf: uniform, --top-k unheard)
            raise UsageError(f"--temperature must be >= 0 and finite, got {args.temperature}")
        if args.top_k is not None and args.top_k < 1:
            raise UsageError(f"--top-k must be positive, got {args.top_k}")
        if not SEED[1](args.seed):
            raise UsageError(f"--seed must be {SEED[0]}, got {args.seed}")
        device = pick_device(args.device)
        cfg, model = runs.load_checkpoint(args.out_dir, device, args.data_dir)
        autocast = autocast_for(device)
        if args.eval:  # exactly train.py's evaluation, on the same fixed validation set
            data = runs.load_data(cfg, with_train=False)
            metrics = evaluate(model, model, data, cfg.micro_batch_size, device, autocast)
            print(show_metrics(metrics))
            return metrics
        codec = Codec(cfg)
        if args.temperature is None:
            args.temperature = 0.0 if codec.stop is not None else 0.8
        if args.temperature == 0 and "top_k" in given:  # greedy decoding takes the most likely token: no cut
            why = "--temperature 0" if "temperature" in given else "temperature 0, the default for arithmetic and " \
                "prosqa: give --temperature too"
            raise UsageError(f"--top-k cuts what sampling draws from, and this decodes greedily ({why})")
        if args.top_k is None and codec.stop is None:
            args.top_k = 200
        torch.manual_seed(args.seed)
        return list(samples(model, codec, args, device, autocast))


if __name__ == "__main__":
    main()
