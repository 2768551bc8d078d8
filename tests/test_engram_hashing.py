"""Engram hashing (dsv41.engram.hashing, MODEL.md §9.2-9.3, EXL3-ENGRAM.md §5.3): the release constants, the
oracle fixture's hash ids (one shot and in chunks), and the hashing rules restated by hand.

Expected values come from MODEL.md §9 / EXL3-ENGRAM.md §5 (release constants), from the oracle fixture (made by
the transformers implementation), or from straightforward restatements written here.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from dsv41.engram.hashing import EngramConstants, EngramHasher, head_shard
from dsv41.engram.token_map import build_compressed_token_map
from dsv41.errors import ConfigError, TokenizerError
from dsv41.tokenizer import Tokenizer
from engram_harness import ORACLE, RELEASE, cfg, fixture_hashes, hasher, input_ids  # noqa: F401 (pytest fixtures)


def trial_division_is_prime(n):
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


# --- release constants (MODEL.md §9.2, EXL3-ENGRAM.md §5.3) --------------------------------------------------------


def test_release_multipliers():
    c = EngramConstants.from_config(RELEASE)
    assert c.multipliers.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]


def test_release_primes():
    c = EngramConstants.from_config(RELEASE)
    assert c.num_rows == (384006168, 384016682)
    assert [int(s) for s in c.primes.flatten(1).sum(1)] == [384006168, 384016682]
    flat = c.primes.flatten().tolist()
    # the 48 buckets are exactly the first 48 primes above 16,000,000, in (layer, order, head) order
    expected = [n for n in range(16_000_000, 16_000_890) if trial_division_is_prime(n)]
    assert flat == expected
    assert (flat[0], flat[1], flat[2], flat[23], flat[24], flat[47]) == (
        16000057, 16000079, 16000081, 16000463, 16000477, 16000889)
    assert c.offsets[0, 0] == 0 and c.offsets[0, 1] == 16000057
    assert c.offsets[1, 23] + c.primes[1, 2, 7] == 384016682


def test_release_rank_split():
    c = EngramConstants.from_config(RELEASE)
    assert head_shard(24, 0, 2) == (0, 12) and head_shard(24, 1, 2) == (12, 24)
    assert c.row_range(1, 0, 12) == (0, 192_001_740)
    assert c.row_range(1, 12, 24) == (192_001_740, 384_006_168)
    assert c.row_range(14, 0, 12) == (0, 192_007_016)
    assert c.row_range(14, 12, 24) == (192_007_016, 384_016_682)


@pytest.mark.parametrize("n_cols,world", [(24, 1), (24, 3), (24, 5), (6, 4), (6, 8), (3, 2)])
def test_head_shard_covers_every_column_once(n_cols, world):
    ranges = [head_shard(n_cols, r, world) for r in range(world)]
    covered = [c for lo, hi in ranges for c in range(lo, hi)]
    assert covered == list(range(n_cols))


def test_num_embeddings_mismatch_is_a_config_error():
    bad = SimpleNamespace(**{**vars(RELEASE), "engram_num_embeddings": [384006168, 1]})
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramConstants.from_config(bad)


# --- against the oracle fixture ------------------------------------------------------------------------------------
def test_fixture_constants(fixture_hashes, cfg):
    c = EngramConstants.from_config(cfg)
    assert torch.equal(c.primes, fixture_hashes["primes"])
    assert torch.equal(c.offsets, fixture_hashes["offsets"])
    assert torch.equal(c.multipliers, fixture_hashes["multipliers"])
    assert list(c.num_rows) == list(cfg.engram_num_embeddings)


def test_fixture_hash_ids_one_shot(hasher, fixture_hashes, input_ids):
    assert torch.equal(hasher.hash(input_ids), fixture_hashes["hash_ids"])


@pytest.mark.parametrize("chunks", [[13, 16, 8] + [1] * 11, [1] * 48, [2, 46], [47, 1], [5, 0, 43]])
def test_fixture_hash_ids_chunked(hasher, fixture_hashes, input_ids, chunks):
    history, parts, start = hasher.new_history(), [], 0
    for n in chunks:
        parts.append(hasher.hash(input_ids[start:start + n], history))
        start += n
    assert torch.equal(torch.cat(parts), fixture_hashes["hash_ids"])


def test_compressed_size_mismatch_is_a_tokenizer_error(cfg):
    bad = SimpleNamespace(**{**vars(RELEASE), "engram_compressed_vocab_size": 99092, "vocab_size": 320,
                             "engram_pad_token_id": 2})
    with pytest.raises(TokenizerError, match="99092"):
        EngramHasher.from_tokenizer(bad, Tokenizer.from_dir(ORACLE))


# --- hashing rules restated by hand ----------------------------------------------------------------------------


def reference_hash(compressed, dead, constants, pad):
    """Row ids by the letter of MODEL.md §9.3, in plain Python integers."""
    out = []
    for t in range(len(compressed)):
        c, blocked = [], False
        for k in range(constants.max_ngram):
            if t - k < 0 or dead[t - k]:
                blocked = True
            c.append(pad if blocked else compressed[t - k])
        per_layer = []
        for li in range(len(constants.layer_ids)):
            mult = constants.multipliers[li].tolist()
            rolling, cols = c[0] * mult[0], []
            for k in range(1, constants.max_ngram):
                rolling ^= c[k] * mult[k]
                for h in range(constants.n_heads):
                    col = (k - 1) * constants.n_heads + h
                    cols.append(rolling % int(constants.primes[li, k - 1, h]) + int(constants.offsets[li, col]))
            per_layer.append(cols)
        out.append(per_layer)
    return torch.tensor(out, dtype=torch.int64)


def test_image_tokens_block_the_look_back(hasher, cfg, input_ids):
    ids = list(input_ids[:20])
    ids[7] = ids[8] = cfg.image_token_id  # an image span of two positions
    dead = [i == cfg.image_token_id for i in ids]
    compressed = [int(hasher.token_map[i]) for i in ids]
    expected = reference_hash(compressed, dead, hasher.constants, hasher.pad_id)
    assert torch.equal(hasher.hash(ids), expected)
    # right after the span every order is the all-pad-lookback n-gram of the current token
    after = hasher.hash([ids[9]])  # a fresh sequence starting with that token
    assert torch.equal(hasher.hash(ids)[9], after[0])
    # and the same in chunks cut inside the span
    history = hasher.new_history()
    parts = [hasher.hash(ids[:8], history), hasher.hash(ids[8:10], history), hasher.hash(ids[10:], history)]
    assert torch.equal(torch.cat(parts), expected)


def test_explicit_dead_mask(hasher, input_ids):
    ids = input_ids[:12]
    dead = torch.zeros(12, dtype=torch.bool)
    dead[5] = True
    compressed = [int(hasher.token_map[i]) for i in ids]
    expected = reference_hash(compressed, dead.tolist(), hasher.constants, hasher.pad_id)
    assert torch.equal(hasher.hash(ids, dead=dead), expected)


def test_many_sequences_in_one_pass(hasher, cfg, input_ids):
    """`hash_many` over several sequences' chunks, step after step (a prompt each, then decode-like steps, an
    empty chunk, a dead mask, an image token, a chunk with no history): each sequence's rows are the rule's
    (`reference_hash` of its whole text) and each history carries on as one `hash` call per chunk leaves it."""
    texts = [list(input_ids[:17]), list(input_ids[5:14]), list(input_ids[20:31])]
    texts[2][4] = cfg.image_token_id
    dead = [[False] * len(t) for t in texts]
    dead[1][3] = True
    for t, d in zip(texts, dead):
        for i, v in enumerate(t):
            d[i] = d[i] or v == cfg.image_token_id
    cuts = [[0, 12, 13, 13, 15, 17], [0, 5, 6, 7, 8, 9], [0, 1, 2, 6, 10, 11]]  # a step's chunk: cuts[i][s:s + 2]
    histories = [hasher.new_history() for _ in texts]
    got = [[] for _ in texts]
    for step in range(5):
        chunks = []
        for i, t in enumerate(texts):
            a, b = cuts[i][step], cuts[i][step + 1]
            chunks.append((t[a:b], histories[i], torch.tensor(dead[i][a:b], dtype=torch.bool)))
        rows = hasher.hash_many(chunks)
        at = 0
        for i, (ids, _, _) in enumerate(chunks):
            got[i].append(rows[at:at + len(ids)])
            at += len(ids)
        assert at == rows.shape[0]
    for i, t in enumerate(texts):
        compressed = [int(hasher.token_map[v]) for v in t]
        assert torch.equal(torch.cat(got[i]), reference_hash(compressed, dead[i], hasher.constants, hasher.pad_id))
    lone = hasher.hash_many([(texts[0][:3], None)])  # no history: the start of a sequence
    assert torch.equal(lone, hasher.hash(texts[0][:3]))
    assert hasher.hash_many([]).shape[0] == 0


def test_hash_ids_stay_inside_their_buckets(hasher, input_ids):
    ids = hasher.hash(input_ids)
    c = hasher.constants
    for li in range(len(c.layer_ids)):
        lo = c.offsets[li]
        hi = lo + c.primes[li].flatten()
        assert bool(((ids[:, li] >= lo) & (ids[:, li] < hi)).all())


# --- model ids the tokenizer lacks -------------------------------------------------------------------------------


def test_ids_beyond_the_tokenizer_hash_like_the_pad(cfg):
    token_map, _ = build_compressed_token_map(Tokenizer.from_dir(ORACLE))
    wider = SimpleNamespace(**{k: getattr(cfg, k) for k in (
        "engram_layer_ids", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
        "engram_compressed_vocab_size", "engram_num_embeddings", "engram_pad_token_id", "image_token_id")},
        vocab_size=330)
    h = EngramHasher(wider, token_map)
    assert torch.equal(h.hash([5, 325, 7]), h.hash([5, cfg.engram_pad_token_id, 7]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        h.hash([330])
