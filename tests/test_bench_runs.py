"""Each benchmark's code path once on the CPU (XLA path, tiny shapes, no fla), and
the fla child's protocol with a stand-in child (no torch needed). CPU timings are
not results: these check the calls, the table and the JSON rows."""

import json
import sys
import textwrap

import pytest

from bench import decode, fla_peer, forward, serving

META = {"date", "commit", "dirty", "versions", "machine", "command"}


def test_forward_sweep_runs_the_xla_path(tmp_path, capsys):
    out = tmp_path / "f.json"
    forward.main(["--impls", "xla", "--shapes", "1,40,2", "--head-dim", "16", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["implementation"] for r in rows] == ["kda_jax-xla"]
    assert rows[0]["ms"] > 0 and META <= set(rows[0])
    assert "kda_jax-xla" not in capsys.readouterr().err


def test_serving_runs_every_kda_jax_row(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert serving.main(["--kda-impl", "xla", "--no-fla", "--lengths", "1,1,40", "--sets", "2",
                         "--static-sets", "1", "--iters", "1", "--repeats", "1", "--heads", "2",
                         "--head-dim", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(r.get("error") is None for r in rows), rows
    assert all(r["ms"] > 0 and r["d2h_per_step"] == 0 and META <= set(r) for r in rows)
    assert rows[0]["command"].startswith("python -m bench.serving --kda-impl xla")
    assert "bucketed + pool" in capsys.readouterr().out


def test_decode_runs_every_kda_jax_step(tmp_path):
    out = tmp_path / "d.json"
    assert decode.main(["--kda-impl", "xla", "--no-fla", "--sizes", "3", "--iters", "1",
                        "--repeats", "1", "--heads", "2", "--head-dim", "16",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["form"], r["steps_per_call"]) for r in rows} == {
        ("dense", 1), ("dense", 8), ("pool", 1), ("pool", 8), ("pool bf16", 1), ("verify", 1)}
    assert len(rows) == 7 and all(r.get("error") is None and r["ms"] > 0 for r in rows), rows
    assert all(META <= set(r) and r["ratio_to_fla"] is None for r in rows)


def test_decode_refuses_a_bad_size():
    with pytest.raises(SystemExit):
        decode.main(["--sizes", "256,0", "--no-fla"])


def test_round_summary():
    rounds = [dict(form="dense", kda_jax_ms=1.0, fla_ms=2.0), dict(form="dense", kda_jax_ms=3.0,
              fla_ms=2.0), dict(form="dense", kda_jax_ms=2.0, fla_ms=2.0),
              dict(form="pool", kda_jax_ms=1.0, fla_ms=1.0)]
    got = decode.summarize(rounds)
    assert got["dense"] == dict(rounds=3, kda_jax_ms=2.0, fla_ms=2.0, ratio_median=1.0,
                                ratio_min=0.5, ratio_max=1.5)
    assert got["pool"]["rounds"] == 1
    assert [decode.round_order(r)[0] for r in range(3)] == ["kda_jax", "fla", "kda_jax"]


# A stand-in for the fla child: the same line protocol, no torch.
FAKE_CHILD = textwrap.dedent("""
    import json, sys
    print("a warning line", flush=True)
    print(json.dumps({"ready": True, "torch": "t", "fla": "f"}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["job"] == "die":
            print("Traceback: CUDA error", flush=True)
            sys.exit(1)
        for form in job.get("forms", []):
            print(json.dumps({"row": {"form": form, "ms": 2.0}}), flush=True)
        print(json.dumps({"done": True}), flush=True)
""")


@pytest.fixture
def fake_child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(FAKE_CHILD)
    return [sys.executable, str(path)]


def test_fla_peer_protocol_and_a_dying_child(fake_child, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # as jax-triton leaves it
    assert "TRITON_CACHE_DIR" not in fla_peer.child_env()
    with fla_peer.FlaPeer(fake_child) as fla:
        assert fla.versions == {"torch": "t", "fla": "f"}
        for _ in range(2):  # the child stays alive between jobs
            got = list(fla.run({"job": "decode", "forms": ["dense", "pool"]}))
            assert [m["row"]["form"] for m in got] == ["dense", "pool"]
        with pytest.raises(fla_peer.FlaUnavailable, match="CUDA error"):
            list(fla.run({"job": "die"}))


def test_a_child_that_does_not_start(tmp_path):
    path = tmp_path / "child.py"
    path.write_text("raise ImportError('No module named fla')")
    with pytest.raises(fla_peer.FlaUnavailable, match="No module named fla"):
        fla_peer.FlaPeer([sys.executable, str(path)])


def test_decode_rounds_alternate_with_the_child(fake_child, monkeypatch, tmp_path):
    monkeypatch.setattr(fla_peer.FlaPeer.__init__, "__defaults__", (fake_child,))
    out = tmp_path / "d.json"
    decode.main(["--kda-impl", "xla", "--sizes", "2", "--rounds", "2", "--iters", "1",
                 "--repeats", "1", "--heads", "2", "--head-dim", "16", "--json", str(out)])
    rows = json.loads(out.read_text())
    rounds = {r["form"]: r for r in rows if "per_round" in r}
    assert set(rounds) == {"dense", "pool", "pool bf16"}
    assert [r["first"] for r in rounds["dense"]["per_round"]] == ["kda_jax", "fla"]
    assert rounds["dense"]["fla_ms"] == 2.0 and rounds["dense"]["rounds"] == 2
    fla_rows = [r for r in rows if r["implementation"].startswith("fla ")]
    assert {r["form"] for r in fla_rows} == {"dense", "pool", "pool bf16", "verify"}
    assert all(r["versions"]["torch"] == "t" for r in rows)
    kda = [r for r in rows if r["implementation"].startswith("kda_jax")]
    assert all(r["ratio_to_fla"] == pytest.approx(r["ms"] / 2.0) for r in kda)


def test_harness_peers_off_and_a_child_that_fails(fake_child, tmp_path):
    from bench import harness

    off = harness.Peers(enabled=False)
    assert [r["ms"] for r in off.rows({"job": "decode"})] == [None]
    assert "unavailable" in next(off.rows({"job": "decode"}))
    with harness.Peers(fake_child) as peers:
        assert [r["form"] for r in peers.rows({"job": "decode", "forms": ["dense"]})] == ["dense"]
        assert peers.versions == {"torch": "t", "fla": "f"}
        died = list(peers.rows({"job": "die"}))
        assert died[0]["ms"] is None and "CUDA error" in died[0]["error"]
        assert peers.child is None  # started again by the next job
        assert [r["form"] for r in peers.rows({"job": "decode", "forms": ["pool"]})] == ["pool"]


def test_harness_results_are_written_after_every_row(tmp_path):
    from bench import harness

    path = tmp_path / "r.json"
    results = harness.Results("bench.decode", ["--sizes", "2"], str(path), heads=2)
    results.add({"ms": 1.0})
    assert [r["ms"] for r in json.loads(path.read_text())] == [1.0]
    results.add({"ms": 2.0}, {"ms": None})
    rows = json.loads(path.read_text())
    assert [r["ms"] for r in rows] == [1.0, 2.0, None]
    assert all(r["heads"] == 2 and r["command"] == "python -m bench.decode --sizes 2"
               for r in rows)


def test_a_tree_row_reruns_the_module_with_the_same_options(tmp_path, monkeypatch):
    from bench import harness

    tree = tmp_path / "0123abc"
    (tree / "kda_jax").mkdir(parents=True)
    (tree / "kda_jax" / "__init__.py").write_text("")
    seen = {}

    def child(path, module, argv):
        seen.update(path=path, module=module, argv=argv)
        return [{"implementation": "kda_jax triton host batch", "ms": 1.5}], "", 0

    monkeypatch.setattr(harness, "tree_rows", child)
    rows = harness.tree_rows_of(str(tree), "bench.decode",
                                ["--sizes", "2", "--json", "x.json", f"--tree={tree}",
                                 "--rounds", "3", "--iters", "1"])
    assert seen["argv"] == ["--sizes", "2", "--iters", "1", "--no-fla"]
    assert rows == [{"implementation": f"tree:{tree} kda_jax triton host batch", "ms": 1.5}]
    monkeypatch.setattr(harness, "tree_rows", lambda *a: ([], "ImportError: PoolRows", 1))
    (row,) = harness.tree_rows_of(str(tree), "bench.decode", [], step="tree")
    assert row["ms"] is None and "PoolRows" in row["error"] and row["tree_commit"] == "0123abc"
    assert row["step"] == "tree"
    # A child that fails partway: its rows, then one that says why.
    monkeypatch.setattr(harness, "tree_rows", lambda *a: ([{"ms": 1.0}], "CUDA error", 1))
    rows = harness.tree_rows_of(str(tree), "bench.decode", [])
    assert [r["ms"] for r in rows] == [1.0, None] and "CUDA error" in rows[1]["error"]
    with pytest.raises(SystemExit):
        decode.main(["--tree", str(tmp_path / "missing"), "--no-fla"])


def test_decode_with_a_tree_that_does_not_import(tmp_path, capsys):
    tree = tmp_path / "broken"
    (tree / "kda_jax").mkdir(parents=True)
    (tree / "kda_jax" / "__init__.py").write_text("raise ImportError('no PoolRows here')")
    out = tmp_path / "d.json"
    assert decode.main(["--kda-impl", "xla", "--no-fla", "--sizes", "2", "--iters", "1",
                        "--repeats", "1", "--heads", "2", "--head-dim", "16", "--tree", str(tree),
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    (bad,) = [r for r in rows if r["implementation"].startswith("tree:")]
    assert bad["ms"] is None and "no PoolRows here" in bad["error"] and bad["step"] == "tree"
    assert "no PoolRows here" in capsys.readouterr().out  # the table says why


def test_decode_rounds_need_only_their_own_forms_and_keep_a_failure(tmp_path, monkeypatch):
    """fla's verify row failing leaves the rounds (dense and pools) to run; a child that
    dies during the rounds leaves its row, which says why, and the rounds before it."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"ready": True, "torch": "t", "fla": "f"}), flush=True)
        jobs = 0
        for line in sys.stdin:
            jobs += 1
            if jobs == 5:  # the sizes' job, round 0's three forms, then round 1's first
                print("Traceback: CUDA error: an illegal memory access", flush=True)
                sys.exit(1)
            for form in json.loads(line).get("forms", []):
                row = {"form": form, "ms": None if form == "verify" else 2.0}
                if form == "verify":
                    row["error"] = "TypeError: num_accepted_tokens"
                print(json.dumps({"row": row}), flush=True)
            print(json.dumps({"done": True}), flush=True)
    """))
    monkeypatch.setattr(fla_peer.FlaPeer.__init__, "__defaults__", ([sys.executable, str(path)],))
    out = tmp_path / "d.json"
    decode.main(["--kda-impl", "xla", "--sizes", "2", "--rounds", "2", "--iters", "1",
                 "--repeats", "1", "--heads", "2", "--head-dim", "16", "--json", str(out)])
    rows = json.loads(out.read_text())
    died = [r for r in rows if "round 1" in r["implementation"]]
    assert len(died) == 1 and "illegal memory access" in died[0]["error"]
    summaries = {r["form"]: r for r in rows if "per_round" in r}
    assert set(summaries) == {"dense", "pool", "pool bf16"}
    assert all(s["rounds"] == 1 for s in summaries.values())


def test_peers_that_do_not_start_are_not_tried_again(tmp_path):
    from bench import harness

    path = tmp_path / "child.py"
    path.write_text("import sys; open(sys.argv[1], 'a').write('x'); raise ImportError('no fla')")
    tries = tmp_path / "tries"
    peers = harness.Peers([sys.executable, str(path), str(tries)])
    assert peers.usable
    for _ in range(3):
        (row,) = peers.rows({"job": "decode"})
        assert row["ms"] is None and "no fla" in row["unavailable"]
    assert tries.read_text() == "x" and not peers.usable
