"""Block identity: Dynamo's test vectors and the seed rules."""
import numpy as np
import pytest

from indexer import hashing


def test_dynamo_vectors_plain():
    toks = list(range(64))
    assert hashing.local_hashes(toks, 16) == [
        15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122]
    assert hashing.sequence_hashes(toks, 16) == [
        15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800]


def test_dynamo_vectors_lora():
    assert hashing.local_hashes(list(range(64)), 16, lora_name="adapterA") == [
        5965835322040480042, 4306606996294919613, 13095135950543577088, 17627402888976088885]


def test_partial_tail_ignored():
    assert len(hashing.sequence_hashes(list(range(40)), 16)) == 2
    assert hashing.sequence_hashes(list(range(15)), 16) == []


def test_numpy_and_list_inputs_agree():
    toks = list(range(1000, 1000 + 16 * 9))
    assert hashing.sequence_hashes(np.array(toks, dtype=np.int64), 16) == hashing.sequence_hashes(toks, 16)


def test_chain_continues_from_parent():
    toks = list(range(128))
    full = hashing.sequence_hashes(toks, 16)
    tail = hashing.chain(hashing.local_hashes(toks[64:], 16), parent=full[3])
    assert full[4:] == tail


def test_cache_salt_changes_block0_and_chain_only_via_parent():
    toks = list(range(64))
    plain = hashing.local_hashes(toks, 16)
    salted = hashing.local_hashes(toks, 16, cache_salt="tenant-1")
    assert salted[0] != plain[0] and salted[1:] == plain[1:]
    seq_plain = hashing.sequence_hashes(toks, 16)
    seq_salted = hashing.sequence_hashes(toks, 16, cache_salt="tenant-1")
    assert all(a != b for a, b in zip(seq_plain, seq_salted))


def test_routable_blocks_never_counts_last_token():
    assert hashing.routable_blocks(64, 16) == 3
    assert hashing.routable_blocks(65, 16) == 4
    assert hashing.routable_blocks(0, 16) == 0


def test_bad_block_size():
    with pytest.raises(ValueError):
        hashing.local_hashes([1, 2, 3], 0)
