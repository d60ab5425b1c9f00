/**
 * `npm test`: starts embedded Postgres, runs every test file with Node's test runner, and stops
 * Postgres afterwards, whatever happened. Extra arguments narrow the files (e.g. `npm test -- parity`).
 */
import { spawn } from 'node:child_process'
import { readdirSync } from 'node:fs'
import { SetupError } from './pg-server'
import { startPostgres } from './stack'

const filters = process.argv.slice(2)
const files = readdirSync('test')
  .filter((f) => f.endsWith('.test.ts') && (!filters.length || filters.some((p) => f.includes(p))))
  .map((f) => `test/${f}`)

const pg = await startPostgres().catch((err) => {
  if (!(err instanceof SetupError)) throw err
  console.error(`npm test: ${err.message}`)
  process.exit(1)
})
let stopping: Promise<void> | undefined
const stop = () => (stopping ??= pg.stop())

const child = spawn(process.execPath, ['--import', 'tsx', '--test', '--test-timeout=180000', ...files], {
  stdio: 'inherit',
  env: { ...process.env, EDGEPG_TEST_PG: JSON.stringify({ host: pg.host, port: pg.port, database: pg.database }) },
})
for (const signal of ['SIGINT', 'SIGTERM'] as const) {
  process.once(signal, () => child.kill(signal))
}
const code: number = await new Promise((resolve) => child.once('exit', (c, s) => resolve(c ?? (s ? 1 : 0))))
await stop()
process.exit(code)
