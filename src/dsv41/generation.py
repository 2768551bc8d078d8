"""`dsv41 generate`'s prompt preparation, shared by the reference forward (cli) and the prepared-folder start.

A module of its own so that `prepared.start` need not import `cli` (which imports it back)."""
from __future__ import annotations

from .errors import DSV41Error


def generation_inputs(args, model, model_dir):
    """`generate`'s (tokenizer, prompt ids with BOS first, sampling params, seed) for a loaded model."""
    from .engine.params import SamplingParams, derive_seed

    tok = model.tokenizer
    if tok is None:
        raise DSV41Error(f"{model_dir}: tokenizer.json is missing")
    if getattr(args, "chat", False):
        # one user turn in the V4.1 chat encoding, as the server renders it (the text never becomes control tokens)
        from .chat.request_mapping import build_chat_prompt

        prompt = build_chat_prompt({"messages": [{"role": "user", "content": args.prompt}],
                                    "chat_template_kwargs": {"thinking": bool(args.think)}})
        ids = tok.encode_pieces(prompt.pieces)
    else:
        ids = tok.encode(args.prompt)
    if not ids or ids[0] != tok.bos_id:
        ids = [tok.bos_id] + ids
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    return tok, ids, params, args.seed if args.seed is not None else derive_seed(ids)
