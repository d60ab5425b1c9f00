import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import { readFileSync } from 'node:fs'
import vm from 'node:vm'
import { webcrypto } from 'node:crypto'
import { WebSocket } from 'ws'
import pg from 'pg'
import { startProxy, pgConfig } from './support/helpers'

// These run the built bundle (what users get); `npm test` builds it first.
let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy.close())

const options = () => ({ ...pgConfig('md5_user'), wsProxy: () => `ws://127.0.0.1:${proxy.port}/v2` })

async function roundTrip(mod: any, extra: object = {}) {
  const client = new mod.Client({ ...options(), webSocketConstructor: WebSocket, ...extra })
  await client.connect()
  const { rows } = await client.query('SELECT $1::text AS greeting, 2 + 2 AS four', ['hi'])
  await client.end()
  return JSON.parse(JSON.stringify(rows)) // plain objects, whichever realm made them
}

test('dist/index.mjs (ESM) connects and queries', async () => {
  const mod = await import('../dist/index.mjs' as string)
  assert.deepEqual(await roundTrip(mod), [{ greeting: 'hi', four: 4 }])
})

test('dist/index.cjs (CommonJS) connects and queries', async () => {
  const mod = createRequire(import.meta.url)('../dist/index.cjs')
  assert.deepEqual(await roundTrip(mod), [{ greeting: 'hi', four: 4 }])
  const pool = new mod.Pool({ ...options(), webSocketConstructor: WebSocket, max: 2 })
  const res = await pool.query('SELECT 1 AS one')
  assert.deepEqual(res.rows, [{ one: 1 }])
  await pool.end()
})

test("in Node, the package is the Node build, on the installed pg: import and require; its classes are pg's", async () => {
  const require = createRequire(import.meta.url)
  const esm = await import('edgepg' as string)
  const cjs = require('edgepg')
  assert.equal(require.resolve('edgepg'), new URL('../dist/node.cjs', import.meta.url).pathname)
  for (const mod of [esm, cjs]) {
    assert.deepEqual(await roundTrip(mod), [{ greeting: 'hi', four: 4 }])
    const pool = new mod.Pool({ ...options(), webSocketConstructor: WebSocket })
    assert.ok(pool instanceof pg.Pool && new mod.Client() instanceof pg.Client, 'instances of pg.Pool and pg.Client')
    assert.equal(mod.Pool.name, 'Pool')
    assert.deepEqual((await pool.query('SELECT 1 AS one')).rows, [{ one: 1 }])
    await pool.end()
  }
})

test('the bundle runs with no Node APIs: no process, Buffer, require or module globals', async () => {
  // A bare V8 context holding only what a browser or Worker offers (WebSocket, WebCrypto, timers).
  const sandbox: Record<string, unknown> = {
    WebSocket, crypto: webcrypto, TextEncoder, TextDecoder, URL, queueMicrotask, setTimeout, clearTimeout, console,
  }
  const context = vm.createContext(sandbox)
  const code = readFileSync(new URL('../dist/index.cjs', import.meta.url), 'utf8')
  const mod: { exports: any } = { exports: {} }
  vm.runInContext(`(function (module, exports) {${code}\n})`, context)(mod, mod.exports)
  assert.equal(vm.runInContext('typeof process + typeof Buffer + typeof require', context), 'undefinedundefinedundefined')
  // md5 auth exercises the bundled md5 (WebCrypto has none); SCRAM exercises WebCrypto PBKDF2.
  assert.deepEqual(await roundTrip(mod.exports), [{ greeting: 'hi', four: 4 }])
  const scram = new mod.exports.Client({ ...options(), ...pgConfig('scram_user'), webSocketConstructor: WebSocket })
  await scram.connect()
  assert.equal((await scram.query('SELECT current_user AS u')).rows[0].u, 'scram_user')
  await scram.end()
})

test('the package bin (npx -p edgepg edgepg-proxy) is the built CLI and runs', async () => {
  const { execFileSync } = await import('node:child_process')
  const pkg = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8'))
  const bin = new URL(`../${pkg.bin['edgepg-proxy']}`, import.meta.url)
  assert.match(readFileSync(bin, 'utf8'), /^#!\/usr\/bin\/env node\n/)
  const help = execFileSync(process.execPath, [bin.pathname, '--help'], { encoding: 'utf8' })
  for (const flag of ['--upstream', '--listen', '--allow', '--max-message-bytes', '--help']) assert.ok(help.includes(flag), flag)
})

test("one DatabaseError: Postgres's errors over WebSocket and httpSql are instances of the exported class, in every build; in Node's, pg's own", async () => {
  const require = createRequire(import.meta.url)
  const builds: Array<[string, any]> = [
    ['edgepg by import (Node build)', await import('edgepg' as string)],
    ['edgepg by require (Node build)', require('edgepg')],
    ['dist/index.mjs (bundle)', await import('../dist/index.mjs' as string)],
    ['dist/index.cjs (bundle)', require('../dist/index.cjs')],
  ]
  for (const [name, mod] of builds) {
    const client = new mod.Client({ ...options(), webSocketConstructor: WebSocket })
    await client.connect()
    const overWs = await client.query('SELECT 1/0').catch((err: unknown) => err)
    await client.end()
    const sql = mod.httpSql({ ...options(), fetchEndpoint: `http://127.0.0.1:${proxy.port}/sql` })
    const overHttp = await sql`SELECT 1/0`.catch((err: unknown) => err)
    for (const [via, err] of [['WebSocket', overWs], ['httpSql', overHttp]] as const) {
      assert.ok(err instanceof mod.DatabaseError, `${name}, ${via}: instanceof the exported DatabaseError`)
      assert.equal((err as any).code, '22012', `${name}, ${via}: Postgres's SQLSTATE`)
      if (name.includes('Node build')) assert.ok(err instanceof pg.DatabaseError, `${name}, ${via}: instanceof pg's DatabaseError`)
    }
  }
})
