/**
 * Debian's Chromium (apt `chromium`, installed by .ci/run), headless, driven by playwright-core.
 * playwright-core never downloads a browser of its own; this one is at /usr/bin/chromium.
 */
import { existsSync } from 'node:fs'
import { chromium, type Browser } from 'playwright-core'

export const CHROMIUM = process.env.EDGEPG_CHROMIUM ?? '/usr/bin/chromium'

export function launchChromium(): Promise<Browser> {
  if (!existsSync(CHROMIUM)) throw new Error(`${CHROMIUM} not found: apt-get install -y chromium (as .ci/run does), or set EDGEPG_CHROMIUM`)
  return chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking'],
  })
}
