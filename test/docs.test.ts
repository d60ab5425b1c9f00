/**
 * The docs against the code: every driver option with its default (src/config.ts) in
 * docs/configuration.md, and the parts `npm run docs` writes from edgepg-proxy's table
 * (proxy/settings.ts) as it writes them, so the docs cannot drift from what runs.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { config, configKeys } from '../src/config'
import { HELP, SETTINGS } from '../proxy/settings'
import { ENV_FILE, REFERENCE_FILE, environmentFile, referencePage } from '../scripts/docs'

const page = readFileSync(REFERENCE_FILE, 'utf8')

/** The table row of the reference whose first cell starts with `cell`. */
const row = (cell: string) => page.split('\n').find((l) => l.startsWith(`| \`${cell}`))

test('docs/configuration.md: every driver option, with its default', () => {
  for (const key of configKeys) {
    const line = row(key)
    assert.ok(line, `docs/configuration.md has a row for ${key}`)
    const value = config[key]
    const documented = line!.split('|')[2].trim()
    if (typeof value === 'boolean') assert.equal(documented, `\`${value}\``, `${key}: the docs say ${documented}, the code ${value}`)
    else assert.ok(value === undefined, `${key}: a non-boolean default is documented by hand; check it (${String(value)})`)
  }
})

test("docs/configuration.md and deploy/edgepg-proxy.env are what `npm run docs` writes from edgepg-proxy's table", () => {
  assert.equal(page, referencePage(page), 'docs/configuration.md: run `npm run docs`')
  assert.equal(readFileSync(ENV_FILE, 'utf8'), environmentFile(), 'deploy/edgepg-proxy.env: run `npm run docs`')
  for (const s of Object.values(SETTINGS)) {
    assert.ok(row(`--${s.flag}`)?.includes(`\`${s.env}\``), `--${s.flag}: a row with ${s.env}`)
    assert.ok(HELP.includes(`--${s.flag}`), `--help names --${s.flag}`)
  }
})

