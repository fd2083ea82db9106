"""One place that turns failures into one line on stderr and an exit status; never a traceback for a user."""

from __future__ import annotations

import os
import sys
import traceback

import click

from kvchat.errors import KvchatError


class FriendlyGroup(click.Group):
    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            status = super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(0)
        except click.ClickException as exc:  # usage errors: one line, not click's three
            _fail(exc.format_message(), exc.exit_code)
        except click.exceptions.Abort:  # click's word for a KeyboardInterrupt (there are no prompts to abort)
            _fail("interrupted", 130)
        except KvchatError as exc:
            _fail(str(exc), exc.exit_status)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except BrokenPipeError:
            # The reader went away (e.g. `| head`): nothing more to say, and nothing more to flush.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except MemoryError:
            _fail("out of memory", 1)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if os.environ.get("KVCHAT_DEBUG"):
                traceback.print_exc()
            _fail(f"internal error: {type(exc).__name__}: {exc} (set KVCHAT_DEBUG=1 for the traceback)", 70)
        sys.exit(status if isinstance(status, int) else 0)


def _fail(message: str, status: int):
    click.echo(f"kvchat: error: {' '.join(message.split())}", err=True)
    sys.exit(status)
