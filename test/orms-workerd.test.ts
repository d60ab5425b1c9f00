/**
 * ORMs inside workerd (miniflare), with and without nodejs_compat: Drizzle (node-postgres driver)
 * and Kysely on edgepg's Pool made per request, and Drizzle's neon-http driver on
 * @neondatabase/serverless pointed at edgepg-proxy's POST /sql. test/workers/orm-worker.mjs is
 * bundled as a user's Worker is (docs/driver.md, "Using it with…"): esbuild, `pg` and `edgepg` aliased to
 * the built driver. Each request runs CRUD and a committed and a rolled-back transaction on a
 * table of its own; the rows left are checked over TCP, and no session may stay open.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { Miniflare } from 'miniflare'
import pg from 'pg'
import { startProxy, testPostgres, pgConfig, eventually, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import { bundleWorker } from './workers/bundle'

const root = fileURLToPath(new URL('..', import.meta.url))
const work = mkdtempSync(join(tmpdir(), 'edgepg-orms-'))
const FINAL = [{ name: 'pear', qty: 20 }, { name: 'plum', qty: 3 }]

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => {
  proxy = await startProxy()
  await bundleWorker(join(root, 'test/workers/orm-worker.mjs'), join(work, 'worker.mjs'))
})
after(async () => {
  await proxy?.close()
  rmSync(work, { recursive: true, force: true })
})

/** What every route answers: the same CRUD and transactions, each ORM its own way. */
const crud = {
  inserted: [{ id: 1, name: 'apple', qty: 1 }, { id: 2, name: 'pear', qty: 2 }],
  selected: [{ id: 2, name: 'pear', qty: 2 }],
  updated: [{ id: 2, qty: 20 }],
  deleted: [{ id: 1 }],
  committed: 2,
  final: FINAL,
}
const expected: Record<string, Record<string, unknown>> = {
  '/drizzle': { ...crud, rolledBack: 'boom', checkedOut: 0 },
  '/kysely': { ...crud, rolledBack: 'boom', checkedOut: 0 },
  '/neon-http': { ...crud, rolledBack: 'division by zero' },
}

for (const nodejsCompat of [false, true]) {
  test(`Drizzle, Kysely and Drizzle's neon-http in workerd ${nodejsCompat ? 'with' : 'without'} nodejs_compat`, async () => {
    const { host, port, database } = testPostgres()
    const mf = new Miniflare({
      modulesRoot: work,
      modules: [{ type: 'ESModule', path: join(work, 'worker.mjs') }],
      compatibilityDate: '2026-04-01',
      compatibilityFlags: nodejsCompat ? ['nodejs_compat'] : [],
      bindings: { PROXY_PORT: String(proxy.port), DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}` },
    })
    const tcp = new pg.Client(pgConfig())
    await tcp.connect()
    try {
      for (const route of Object.keys(expected)) {
        // The second request logs in from the Worker itself (SCRAM in workerd), not at the proxy.
        for (const authOffload of [true, false]) {
          const table = `orm_${route.slice(1).replace('-', '_')}_${Number(nodejsCompat)}${Number(authOffload)}_${process.pid}`
          const res = await within(30_000, `${route} in workerd`, mf.dispatchFetch(`http://worker.test${route}?table=${table}&authOffload=${authOffload}`))
          const body: any = await res.json()
          assert.equal(res.status, 200, `${route}: ${JSON.stringify(body)}`)
          const { rolledBack, ...rest } = body
          const { rolledBack: why, ...want } = expected[route]
          assert.deepEqual(rest, want, `${route} (authOffload ${authOffload})`)
          assert.match(rolledBack, new RegExp(String(why)), `${route}: the failed transaction's error`)
          assert.deepEqual((await tcp.query(`SELECT name, qty FROM ${table} ORDER BY id`)).rows, FINAL, `${route}: what Postgres kept (nothing of the rolled-back transaction)`)
          await tcp.query(`DROP TABLE ${table}`)
        }
      }
      await eventually(() => proxy.sessionCount === 0, "every Worker's session closed (ctx.waitUntil(pool.end()))")
    } finally {
      await tcp.end()
      await mf.dispose()
    }
  })
}
