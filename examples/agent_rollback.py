"""AI agent rollback: try each piece of generated code on a fork first. If it works, replay it
on the original; if it fails, throw the fork away: the original never sees the damage.

Seed scenario: "Fork" (AI agent rollback; also "fork a risky operation, discard when done").
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys

from sandlot import Sandbox

# Two "AI-generated" steps: one breaks the project and fails, one works.
GENERATED = [
    "rm -rf /project/src && sed -i 's/1/one/' /project/VERSION && false",
    "mkdir -p /project/docs && echo '# Usage' > /project/docs/README.md && test -d /project/src",
]


def main() -> int:
    sandbox = Sandbox.create(timeout=300)
    try:
        sandbox.commands.run("mkdir -p /project/src && echo 'print(1)' > /project/src/main.py "
                             "&& echo 1 > /project/VERSION", check=True)
        for step, code in enumerate(GENERATED):
            branch = sandbox.fork()[0]
            try:
                result = branch.commands.run(code, timeout=60)
            finally:
                branch.kill()
            if result.ok:
                sandbox.commands.run(code, timeout=60, check=True)  # replay on the original
                print(f"step {step}: worked on a fork, replayed on the original")
            else:
                print(f"step {step}: failed on a fork (exit {result.exit_code}), discarded")
        state = sandbox.commands.run(
            "cat /project/VERSION; ls /project/src; ls /project/docs").stdout.split()
        print(f"original: {state}")
        return 0 if state == ["1", "main.py", "README.md"] else 1
    finally:
        sandbox.kill()


if __name__ == "__main__":
    sys.exit(main())
