"""What a notification's text may do in each target's markup: nothing. Run, project and
layer names come from clients, so every chat or mail notification is sent as plain text
with that text escaped for the target (Slack mrkdwn, Discord markdown and mentions, mail
HTML), and Discord is told to ping nobody (`allowed_mentions`)."""

from __future__ import annotations

import re
from typing import Any

# Discord webhooks as apprise writes them, and as Discord hands them out
_DISCORD_APPRISE = re.compile(r"^discord://(?:[^@/]*@)?(?P<id>[0-9]+)/(?P<token>[^/?#]+)")
_DISCORD_HTTPS = re.compile(r"^https://(?:[a-z]+\.)?discord(?:app)?\.com/api/webhooks/"
                            r"(?P<id>[0-9]+)/(?P<token>[^/?#]+)")
DISCORD_MAX_CHARS = 2000  # Discord refuses longer content
# markdown punctuation Discord acts on, and the characters of <@id>, <#id> and links
_DISCORD_SPECIAL = re.compile(r"([\\*_~`|>\[\]()#<:@-])")
_LINE_BREAKS = re.compile(r"[\r\n\u2028\u2029]+")


def discord_webhook(url: str) -> str | None:
    """The https webhook URL of a Discord target (apprise's discord://ID/TOKEN or
    Discord's own https URL), or None for any other target."""
    match = _DISCORD_APPRISE.match(url) or _DISCORD_HTTPS.match(url)
    if match is None:
        return None
    return f"https://discord.com/api/webhooks/{match['id']}/{match['token']}"


def one_line(text: str) -> str:
    """A title: line breaks would start new header lines in a mail or new paragraphs."""
    return _LINE_BREAKS.sub(" ", text).strip()


def escape_discord(text: str) -> str:
    """Client text as literal Discord markdown: every character Discord formats, links
    or mentions with is backslash-escaped (`<@U1>`, `@everyone`, `[x](url)`, `https:`)."""
    return _DISCORD_SPECIAL.sub(r"\\\1", text)


def discord_payload(title: str, text: str, link: str) -> dict[str, Any]:
    """A Discord webhook body: the escaped title (bold) and text, then this server's
    `link` as it is (ours, so it stays a link), pinging no one."""
    content = f"**{escape_discord(one_line(title))}**\n{escape_discord(text)}"
    content = content[:DISCORD_MAX_CHARS - len(link) - 2]
    return {"content": f"{content}\n{link}" if link else content,
            "allowed_mentions": {"parse": []}}
