"""``dynamo-ext audit``: one argparse tree (run, merge, diff), ``run`` the default subcommand."""

from __future__ import annotations

from dynamo_ext.audit.cli import EXIT_ERROR, SUBCOMMANDS, main, parser


def test_one_tree_parses_every_subcommand():
    tree = parser()
    run = tree.parse_args(["audit", "run", "--nproc", "3", "train.py"])
    merge = tree.parse_args(["audit", "merge", "/shared/audit", "--world-size", "8"])
    diff = tree.parse_args(["audit", "diff", "old.json", "new.json", "--fail-on-new"])
    assert (run.subcommand, run.nproc, run.target) == ("run", 3, "train.py")
    assert (merge.subcommand, merge.directory, merge.world_size) == ("merge", "/shared/audit", 8)
    assert (diff.subcommand, diff.old, diff.new, diff.fail_on_new) == ("diff", "old.json", "new.json", True)
    assert SUBCOMMANDS == ("run", "merge", "diff")


def test_run_is_the_default_subcommand(capsys):
    # Refused before any rank starts.
    for argv in (["audit", "--nproc", "-1"], ["audit", "run", "--nproc", "-1"]):
        assert main(argv) == EXIT_ERROR
        assert "dynamo-ext audit: error: --nproc must be at least 1, got -1" in capsys.readouterr().err
