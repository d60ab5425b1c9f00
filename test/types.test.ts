import { test } from 'node:test'
import assert from 'node:assert/strict'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'

test('the published .d.ts types a typical usage file (tsc --noEmit)', () => {
  const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc')
  const { status, stdout, stderr } = spawnSync(process.execPath, [tsc, '-p', 'test/types/tsconfig.json'], { encoding: 'utf8' })
  assert.equal(status, 0, stdout + stderr)
})
