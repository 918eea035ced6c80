"""Convert checkpoints between Hugging Face and Megatron (distributed checkpoint).

    python tools/convert_checkpoint.py import --hf-model HF_DIR --megatron-path OUT [--dtype bf16]
    python tools/convert_checkpoint.py export --megatron-path DIR --hf-model OUT [--hf-config HF_DIR]

Architectures: Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2 (QKV bias), Qwen3
(q/k norm), and Mixture of Experts: Qwen3-MoE and Mixtral (Megatron's MoE layer with
sequential experts; expert-parallel sharding is chosen at load time too); tied or untied
embeddings; GQA. Safetensors only (no pickle); the output is
written to a temporary directory and renamed at the end. TP/PP sharding is chosen when
a run loads the checkpoint (``megatron_branch.hf.convert.load_megatron``). Runs on CPU.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> Megatron distributed checkpoint")
    imp.add_argument("--hf-model", required=True, help="HF directory (config.json + *.safetensors)")
    imp.add_argument("--megatron-path", required=True, help="output directory")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    imp.add_argument("--tp", type=int, default=1, help="accepted for compatibility: sharding is chosen at load time")
    imp.add_argument("--pp", type=int, default=1, help="accepted for compatibility: sharding is chosen at load time")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    exp = sub.add_parser("export", help="Megatron distributed checkpoint -> HF directory")
    exp.add_argument("--megatron-path", required=True, help="a directory written by import")
    exp.add_argument("--hf-model", required=True, help="output HF directory")
    exp.add_argument("--hf-config", default=None, help="take config.json from this HF directory instead")
    exp.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    import megatron_branch as mb
    from megatron_branch.distributed import init_distributed
    from megatron_branch.hf.convert import export_hf, import_hf

    from megatron_branch.progress import Progress

    mb.enable_cpu()
    init_distributed()
    bar = Progress(3, args.command)

    def progress(msg: str) -> None:
        bar.update(msg)

    try:
        if args.command == "import":
            import_hf(args.hf_model, args.megatron_path, args.dtype, args.overwrite, progress)
        else:
            export_hf(args.megatron_path, args.hf_model, args.hf_config, args.overwrite,
                      int(args.max_shard_gb * (1 << 30)), progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.__exit__(None, None, None)
    print(f"{args.command}: done -> {args.megatron_path if args.command == 'import' else args.hf_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
