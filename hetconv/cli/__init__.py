"""The commands: one module per `hetconv-*` entry point, each a parser, its checks and a main."""
