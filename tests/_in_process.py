"""A command's main() run in the test's own process, for the checks it makes before any work
starts: the same exit code, stdout and stderr as the command's process gives, without starting
one (Python, numpy and Numba imported afresh: about two seconds a case on two cores). What only a
process shows (the status the shell sees, nothing printed on import, no traceback past main) is
checked by one real run of each command beside its in-process matrix."""
import subprocess


def run_main(main, args, capsys):
    """main(args) -> subprocess.CompletedProcess(args, exit code, stdout, stderr), as a run of
    the command would give them; an exception main does not turn into a message propagates and
    fails the test, as a traceback in the process's stderr would."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)
