"""Bad input raises an error naming the collective and the rank, within the timeout.

The absent rank (rank 0) never calls the collective; it stays away until the others have
given up (a flag file each, after their timeout error), at most ``TIMEOUT_S + 2`` s."""

import comm_workers as cw
from shardwise.launch import spawn

TIMEOUT_S = 2.0


def test_mismatches_wrong_group_and_absent_rank(tmp_path):
    results = spawn(cw.bad_input, 3, (TIMEOUT_S, str(tmp_path)), join_timeout_s=120)
    for rank, out in enumerate(results):
        assert out["shape"].startswith(f"error: all_reduce(ring) on rank {rank}")
        assert "numel: rank 0 has 10, rank 2 has 12" in out["shape"]
        assert "dtype: rank 1 has float32, rank 0 has int32" in out["dtype"]
        assert "collective: rank 0 has all_reduce, rank 1 has broadcast" in out["mixed"]
        assert out["bad_op"].startswith("ValueError: all_reduce: op must be")
        assert out["mean_int"].startswith("ValueError: all_reduce: op 'mean'")
        assert "butterfly" in out["bad_algo"]
        assert out["still_works"] == [3.0] * 5
    assert results[2]["not_member"].startswith("error: all_reduce on rank 2: this rank is not "
                                                "a member")
    assert "src=2 is not in the group" in results[0]["src_outside"]
    for rank in (1, 2):
        msg = results[rank]["absent"]
        assert msg.startswith(f"timeout: all_reduce(ring) argument check on rank {rank}"), msg
        assert "rank 0" in msg
        assert TIMEOUT_S <= results[rank]["absent_s"] < TIMEOUT_S + 3


def test_absent_rank_times_out_without_the_check_too(tmp_path):
    out = spawn(cw.absent_unchecked, 2, (TIMEOUT_S, str(tmp_path)), join_timeout_s=60)[1]
    assert out["absent"].startswith("timeout: all_reduce(ring) on rank 1"), out
    assert "receive from rank 0" in out["absent"]
    assert TIMEOUT_S <= out["seconds"] < TIMEOUT_S + 3
