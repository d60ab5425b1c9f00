/**
 * The README's configuration reference against the code: every driver option with its default
 * (src/config.ts), and every edgepg-proxy setting with its flag, environment variable and default
 * (proxy/config.ts), so the docs cannot drift from what runs.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { config, configKeys } from '../src/config'
import { SETTINGS } from '../proxy/config'

const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8')
const reference = readme.slice(readme.indexOf('## Configuration reference'), readme.indexOf('\n## ', readme.indexOf('## Configuration reference') + 1))

/** The table row of the reference whose first cell starts with `cell`. */
const row = (cell: string) => reference.split('\n').find((l) => l.startsWith(`| \`${cell}`))

test('README: every driver option is in the configuration reference, with its default', () => {
  assert.ok(reference.length > 0, 'README has a "## Configuration reference" section')
  for (const key of configKeys) {
    const line = row(key)
    assert.ok(line, `README's configuration reference has a row for ${key}`)
    const value = config[key]
    const documented = line!.split('|')[2].trim()
    if (typeof value === 'boolean') assert.equal(documented, `\`${value}\``, `${key}: README says ${documented}, the code ${value}`)
    else assert.ok(value === undefined, `${key}: a non-boolean default is documented by hand; check it (${String(value)})`)
  }
})

test('README: every edgepg-proxy setting is in the configuration reference, with its variable and default', () => {
  for (const s of Object.values(SETTINGS) as Array<{ flag: string; env: string; arg?: string; default?: string; kind: string }>) {
    const line = row(`--${s.flag}${s.arg ? ' ' + s.arg : ''}\``)
    assert.ok(line, `README's configuration reference has a row for --${s.flag}`)
    const [, , env, def] = line!.split('|').map((c) => c.trim())
    assert.equal(env, `\`${s.env}\``, `--${s.flag}: environment variable`)
    assert.equal(def, s.default ?? (s.kind === 'switch' ? 'off' : 'none'), `--${s.flag}: default`)
  }
})
