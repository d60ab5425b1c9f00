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

// Before Postgres starts: a signal now goes to the tests (Postgres then stops, below), or ends
// this process before they run (test/support/pg-server.ts stops Postgres on exit).
let child: ReturnType<typeof spawn> | undefined
for (const signal of ['SIGINT', 'SIGTERM'] as const) {
  process.once(signal, () => (child ? child.kill(signal) : process.exit(130)))
}

const pg = await startPostgres().catch((err) => {
  if (!(err instanceof SetupError)) throw err
  console.error(`npm test: ${err.message}`)
  process.exit(1)
})
// (EDGEPG_TEST_NAME narrows to the tests whose names match it, as --test-name-pattern does.)
const named = process.env.EDGEPG_TEST_NAME ? [`--test-name-pattern=${process.env.EDGEPG_TEST_NAME}`] : []
child = spawn(process.execPath, ['--import', 'tsx', '--test', '--test-timeout=180000', ...named, ...files], {
  stdio: 'inherit',
  env: { ...process.env, EDGEPG_TEST_PG: JSON.stringify({ host: pg.host, port: pg.port, database: pg.database }) },
})
const code: number = await new Promise((resolve) => child!.once('exit', (c, s) => resolve(c ?? (s ? 1 : 0))))
await pg.stop()
process.exit(code)
