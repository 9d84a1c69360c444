"""A stand-in for MinIO's `mc` client and the admin API behind it, for scripts/minio_init.sh.

Neither the MinIO server nor `mc` is packaged on PyPI or Debian (both are Go binaries, fetched
from dl.min.io), so the tests cannot run them. This fake reproduces what the pinned client
(minio/mc RELEASE.2025-04-16T18-13-26Z) prints and returns on each path the script takes, read
from mc's own source at that tag:

- `alias set`: stores the alias; wrong credentials -> "Unable to initialize new alias from the
  provided credentials." and exit 1 (cmd/alias-set.go).
- `mb [--ignore-existing|-p]`: "Bucket created successfully `ALIAS/B`."; an existing bucket
  without -p is an error, exit 1 (cmd/mb-main.go).
- `admin policy create`: replaces the document (MinIO's AddCannedPolicy); "Created policy `P`
  successfully." (cmd/admin-policy-create.go).
- `admin user add`: sets the secret of a new or existing user; "Added user `K` successfully."
- `admin policy attach P --user K`: unknown policy or user -> exit 1; a policy already attached
  is the server's XMinioAdminPolicyChangeAlreadyApplied, which mc since 2024-10-08 treats as
  success (cmd/admin-policy-attach.go); prints "Attached Policies: [P]\\nTo User: K".
- `admin user info`: text "AccessKey: K\\nStatus: enabled\\nPolicyName: P1,P2\\nMemberOf: []";
  with --json, json.MarshalIndent(" ") of status, accessKey, policyName (omitted when empty),
  userStatus (cmd/admin-user-add.go, userMessage).
- Errors go to stderr as "mc: <ERROR> MESSAGE CAUSE." with exit status 1 (cmd/error.go).

The server's state is a JSON file (FAKE_MC_STATE): root credentials, buckets, policies, users.
FAKE_MC_DROP_ATTACH=1 makes the server accept an attach without recording it (a misbehaving IAM),
so the script's read-back can be seen to catch it. Every call is appended to FAKE_MC_STATE.log.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ALREADY = "XMinioAdminPolicyChangeAlreadyApplied"


def fail(message: str, cause: str) -> None:
    print(f"mc: <ERROR> {message} {cause}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: list[str]) -> None:
    state_path = Path(os.environ["FAKE_MC_STATE"])
    with open(f"{state_path}.log", "a") as log:
        log.write(json.dumps(argv) + "\n")
    state = json.loads(state_path.read_text())
    as_json, config_dir, args, i = False, Path.home() / ".mc", [], 0
    while i < len(argv):  # mc's global flags may stand anywhere
        if argv[i] == "--json":
            as_json = True
        elif argv[i] == "--config-dir":
            config_dir, i = Path(argv[i + 1]), i + 1
        else:
            args.append(argv[i])
        i += 1
    aliases_file = config_dir / "config.json"
    aliases = json.loads(aliases_file.read_text())["aliases"] if aliases_file.exists() else {}

    def server(target: str) -> str:
        alias = target.split("/", 1)[0]
        if alias not in aliases:
            fail("Unable to initialize admin connection.", f"No such alias `{alias}` found.")
        if aliases[alias] != [state["url"], *state["root"]]:
            fail(
                "Unable to initialize admin connection.",
                "The Access Key Id you provided does not exist in our records.",
            )
        return alias

    user = None
    if "--user" in args:
        at = args.index("--user")
        user, args = args[at + 1], args[:at] + args[at + 2 :]
    words = [a for a in args if not a.startswith("-")]
    match words:
        case ["alias", "set", alias, url, access, secret]:
            if url != state["url"] or [access, secret] != state["root"]:
                fail(
                    "Unable to initialize new alias from the provided credentials.",
                    "The Access Key Id you provided does not exist in our records.",
                )
            config_dir.mkdir(parents=True, exist_ok=True)
            aliases_file.write_text(json.dumps({"aliases": {**aliases, alias: [url, access, secret]}}))
            print(f"Added `{alias}` successfully.")
        case ["mb", target]:
            server(target)
            bucket = target.split("/", 1)[1]
            if bucket in state["buckets"] and not ({"--ignore-existing", "-p"} & set(args)):
                fail(
                    f"Unable to make bucket `{target}`.",
                    "Your previous request to create the named bucket succeeded and you already own it.",
                )
            state["buckets"] = sorted({*state["buckets"], bucket})
            print(f"Bucket created successfully `{target}`.")
        case ["admin", "policy", "create", target, name, path]:
            server(target)
            try:
                state["policies"][name] = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                fail("Unable to create new policy.", f"{e}.")
            print(f"Created policy `{name}` successfully.")
        case ["admin", "user", "add", target, access, secret]:
            server(target)
            known = state["users"].get(access, {"policies": []})
            state["users"][access] = {**known, "secret": secret}
            print(f"Added user `{access}` successfully.")
        case ["admin", "policy", "attach", target, *policies] if user:
            server(target)
            if any(p not in state["policies"] for p in policies):
                fail("Unable to make user/group policy association.", "The canned policy does not exist.")
            if user not in state["users"]:
                fail("Unable to make user/group policy association.", "The specified user does not exist.")
            attached = state["users"][user]["policies"]
            new = [p for p in policies if p not in attached]
            if new and not os.environ.get("FAKE_MC_DROP_ATTACH"):
                attached += new
            # nothing new: the server answers ALREADY, which mc turns into success with an empty result
            print(f"Attached Policies: {'[' + ' '.join(policies) + ']'}\nTo User: {user}")
        case ["admin", "user", "info", target, access]:
            server(target)
            if access not in state["users"]:
                fail("Unable to get user info.", "The specified user does not exist.")
            policy = ",".join(state["users"][access]["policies"])
            if as_json:
                message = {
                    "status": "success",
                    "accessKey": access,
                    **({"policyName": policy} if policy else {}),
                    "userStatus": "enabled",
                }
                print(json.dumps(message, indent=1))
            else:
                print(f"AccessKey: {access}\nStatus: enabled\nPolicyName: {policy}\nMemberOf: []")
        case _:
            fail(f"`{' '.join(argv)}` is not a command this fake knows.", "Extend tests/deploy/fake_mc.py.")
    state_path.write_text(json.dumps(state))


if __name__ == "__main__":
    main(sys.argv[1:])
