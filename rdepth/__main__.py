import sys

try:  # a Ctrl-C while Python imports the command line: one line, never a traceback
    from rdepth.cli.main import main
except KeyboardInterrupt:
    print("rdepth: interrupted", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":  # (not when a spawned child process imports this module as __mp_main__)
    sys.exit(main())
