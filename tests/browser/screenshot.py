"""A PNG of a report as a reader sees it: headless Chromium (tests/browser/chromium.py) at a laptop's width.

    python tests/browser/screenshot.py reports/tiny-default-advise.html reports/tiny-default-advise.png
    python tests/browser/screenshot.py REPORT.html OUT.png --height 2400   # the top of the page only

How reports/tiny-default-advise.png is made from reports/tiny-default-advise.html.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

from chromium import Chromium

LAPTOP_WIDTH = 1366


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--height", type=int, default=None, help="clip to this many pixels from the top")
    p.add_argument("--dark", action="store_true")
    args = p.parse_args()
    with Chromium() as browser:
        browser.open(args.report.resolve().as_uri(), LAPTOP_WIDTH, 900, dark=args.dark)
        if args.height is None:
            browser.screenshot(args.out)
        else:
            clip = {"x": 0, "y": 0, "width": LAPTOP_WIDTH, "height": args.height, "scale": 1}
            reply = browser.send(
                "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
            )
            args.out.write_bytes(base64.b64decode(reply["data"]))
    print(args.out)


if __name__ == "__main__":
    main()
