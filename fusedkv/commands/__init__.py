"""The `fusedkv` subcommands that belong to no library package: `plans`, `generate`, `convert`.

Every subcommand, here or in its package (`fusedkv.train.command`, `fusedkv.eval.command`, ...), is a
module with `register(subparsers)`, which adds its parser and sets `func` (its handler); `fusedkv.cli`
lists the modules.
"""
