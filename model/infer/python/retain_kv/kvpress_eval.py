"""Retain policies in kvpress's evaluation harness: the `evaluation/` folder of a kvpress checkout,
whose evaluate.py picks a press by name from evaluate_registry.PRESS_REGISTRY and sets its
compression_ratio. This adds retain_<kind> entries to that registry and runs evaluate.py's CLI:

    python -m retain_kv.kvpress_eval KVPRESS/evaluation --policy trimkv=PATH [--policy …] -- \
        --model Qwen/Qwen3-4B --dataset ruler --data_dir 4096 --press_name retain_trimkv --compression_ratio 0.75

A retain press evicts while prefilling and while decoding (a PrefillDecodingPress), so kvpress's
pipeline accepts one question per context for it, as for its own decoding presses."""
import argparse
import os
import sys

from .press import RetainPress


def retain_presses(policies):
    """{"retain_<name>": RetainPress(path, compression_ratio=0.5)} for a {name: path} mapping (the
    ratio is the placeholder evaluate.py replaces with its --compression_ratio)."""
    return {f"retain_{name}": RetainPress(path, compression_ratio=0.5) for name, path in policies.items()}


def parse_policies(items):
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"kvpress_eval: --policy {item!r}: expected NAME=PATH")
        out[name] = path
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m retain_kv.kvpress_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("evaluation_dir", help="the evaluation/ folder of a kvpress checkout")
    ap.add_argument("--policy", action="append", default=[], help="NAME=PATH: registers press retain_NAME")
    args = ap.parse_args(ours)
    if not os.path.isfile(os.path.join(args.evaluation_dir, "evaluate_registry.py")):
        raise SystemExit(f"kvpress_eval: {args.evaluation_dir}: no evaluate_registry.py (give kvpress's evaluation/)")
    presses = retain_presses(parse_policies(args.policy))
    os.chdir(args.evaluation_dir)  # evaluate.py reads ./evaluate_config.yaml and imports its neighbours
    sys.path.insert(0, os.getcwd())
    import evaluate_registry

    evaluate_registry.PRESS_REGISTRY.update(presses)
    import evaluate
    import fire

    sys.argv = ["evaluate.py"] + rest
    fire.Fire(evaluate.CliEntryPoint)


if __name__ == "__main__":
    main()
