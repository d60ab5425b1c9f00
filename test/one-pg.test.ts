/**
 * One pg: an app with its own pg 8.x (here pinned to 8.23.0) installs the packed edgepg, and npm
 * keeps one copy of pg (edgepg's range takes the app's), so what edgepg's Node build throws is the
 * app's `pg.DatabaseError`, as Kysely's and the ORMs' error handling expects.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'
import { startProxy, pgConfig } from './support/helpers'
import { packedTarball } from './support/pack'

const run = promisify(execFile)
const work = mkdtempSync(join(tmpdir(), 'edgepg-one-pg-'))
const app = join(work, 'app')
const APP_PG = '8.23.0'

let proxy: Awaited<ReturnType<typeof startProxy>>
let tarball: string

before(async () => {
  proxy = await startProxy()
  tarball = await packedTarball()
  await run('mkdir', [app])
  writeFileSync(join(app, 'package.json'), JSON.stringify({ name: 'one-pg-app', private: true, type: 'module', dependencies: { pg: APP_PG, edgepg: `file:${tarball}`, ws: '^8' } }, null, 2))
  await run('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error'], { cwd: app, timeout: 240_000 })
})

after(async () => {
  await proxy?.close()
  rmSync(work, { recursive: true, force: true })
})

/** Every pg package under `dir`'s node_modules, nested ones included. */
function copiesOfPg(dir: string): string[] {
  const found: string[] = []
  const walk = (modules: string) => {
    if (!existsSync(modules)) return
    for (const name of readdirSync(modules)) {
      if (name === 'pg') found.push(join(modules, name))
      if (name.startsWith('@')) for (const scoped of readdirSync(join(modules, name))) walk(join(modules, name, scoped, 'node_modules'))
      else walk(join(modules, name, 'node_modules'))
    }
  }
  walk(join(dir, 'node_modules'))
  return found
}

test(`an app with pg ${APP_PG} of its own gets one copy of pg, and edgepg's errors are its pg.DatabaseError`, async () => {
  assert.deepEqual(copiesOfPg(app), [join(app, 'node_modules', 'pg')])
  const { user, password, host, port, database } = pgConfig('scram_user')
  writeFileSync(
    join(app, 'check.mjs'),
    `import pg from 'pg'
import { WebSocket } from 'ws'
import { Pool } from 'edgepg'
const pool = new Pool({ user: ${JSON.stringify(user)}, password: ${JSON.stringify(password)}, host: ${JSON.stringify(host)}, port: ${port}, database: ${JSON.stringify(database)},
  webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${proxy.port}/v2' })
const err = await pool.query('SELECT 1/0').catch((e) => e)
await pool.end()
console.log(JSON.stringify({ code: err.code, isDatabaseError: err instanceof pg.DatabaseError }))
`
  )
  const { stdout } = await run(process.execPath, ['check.mjs'], { cwd: app, timeout: 60_000 })
  assert.deepEqual(JSON.parse(stdout), { code: '22012', isDatabaseError: true })
  assert.equal(JSON.parse(readFileSync(join(app, 'node_modules/pg/package.json'), 'utf8')).version, APP_PG)
})

test('the tarball npm packs from a fresh clone holds the built driver, proxy, CLI and types (prepack builds them)', async () => {
  const { stdout } = await run('tar', ['-tzf', tarball])
  const files = stdout.split('\n')
  for (const file of ['dist/index.mjs', 'dist/index.cjs', 'dist/node.mjs', 'dist/index.d.ts', 'dist/proxy.mjs', 'dist/cli.mjs']) {
    assert.ok(files.includes(`package/${file}`), `${file} in the tarball: ${files.join(' ')}`)
  }
  const installed = join(app, 'node_modules/edgepg')
  const { stdout: help } = await run(process.execPath, [join(installed, 'dist/cli.mjs'), '--help'])
  assert.match(help, /--upstream/)
})
