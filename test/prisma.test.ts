/**
 * Prisma ORM on edgepg, as a user sets it up: a client generated at test time from
 * test/prisma/schema.prisma, `@prisma/adapter-pg` given edgepg's Pool, through edgepg-proxy.
 * In Node (the package's Node build, whose Pool is an instance of pg's own) and inside workerd
 * (miniflare; the Worker bundled with `pg` aliased to edgepg, Prisma's query compiler as a
 * CompiledWasm module), with and without nodejs_compat. test/prisma/ops.ts is what is asked.
 *
 * `prisma generate` runs no engine, but the CLI first looks for Prisma's schema engine and
 * downloads it when missing (binaries.prisma.sh, unreachable here): PRISMA_SCHEMA_ENGINE_BINARY
 * names a file that stands in for it, which generate never runs.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import { Miniflare } from 'miniflare'
import pg from 'pg'
import { WebSocket } from 'ws'
import { startProxy, testPostgres, pgConfig, eventually, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import { bundleWorker } from './workers/bundle'
import { docBlock } from './support/doc-blocks'

const root = fileURLToPath(new URL('..', import.meta.url))
const here = join(root, 'test/prisma')
const work = mkdtempSync(join(tmpdir(), 'edgepg-prisma-'))

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => {
  proxy = await startProxy()
  const standIn = join(work, 'no-schema-engine')
  writeFileSync(standIn, '#!/bin/sh\nexit 1\n', { mode: 0o755 })
  await promisify(execFile)(join(root, 'node_modules/.bin/prisma'), ['generate', '--schema', join(here, 'schema.prisma')], {
    cwd: root,
    env: { ...process.env, PRISMA_SCHEMA_ENGINE_BINARY: standIn, CHECKPOINT_DISABLE: '1', PRISMA_HIDE_UPDATE_MESSAGE: '1' },
    timeout: 120_000,
  })
  const admin = new pg.Client(pgConfig())
  await admin.connect()
  await admin.query(readFileSync(join(here, 'schema.sql'), 'utf8'))
  await admin.end()
})
after(async () => {
  await proxy?.close()
  rmSync(work, { recursive: true, force: true })
})

test("Prisma in Node: @prisma/adapter-pg on edgepg's Pool (the package's Node build)", async () => {
  const { Pool } = await import('edgepg' as string) // resolved as a user's import is: package.json "exports", "node"
  const { PrismaPg } = await import('@prisma/adapter-pg')
  const { PrismaClient, Prisma } = await import('./prisma/generated/node/client.ts' as string)
  const { runOps } = await import('./prisma/ops')
  const pool = new Pool({ ...pgConfig(), max: 5, webSocketConstructor: WebSocket, wsProxy: () => proxy.url })
  // The adapter uses a Pool it is given only if it is an instance of pg's Pool; else it makes its own from it, over TCP.
  assert.ok(pool instanceof pg.Pool, "edgepg's Pool (Node build) is an instance of the installed pg's Pool")
  const prisma = new PrismaClient({ adapter: new PrismaPg(pool) })
  try {
    const sessionsBefore = proxy.sessionCount
    assert.deepEqual(await within(60_000, 'the Prisma operations', runOps(prisma, Prisma, `node-${process.pid}`)), ['crud', 'relations', 'batch transaction', 'interactive transaction', 'rollback', 'raw', 'P2002', 'cleanup'])
    assert.ok(proxy.sessionCount > sessionsBefore, `Prisma's queries went through edgepg-proxy (${proxy.sessionCount} sessions open)`)
  } finally {
    await prisma.$disconnect()
    await pool.end()
  }
  await eventually(() => proxy.sessionCount === 0, 'every session through the proxy closed')
})

const WASM = 'query_compiler_fast_bg.wasm'
const DATABASE_URL = () => {
  const { host, port, database } = testPostgres()
  return `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`
}

/**
 * `entry` bundled as a Worker (`pg` aliased to edgepg) with this test's workerd client, for which a
 * page's `./generated/client` stands; the query compiler's wasm stays a module of its own (workerd
 * compiles no wasm at run time). Gives a workerd for it, with `bindings`.
 */
async function prismaWorker(entry: string, name: string) {
  await bundleWorker(entry, join(work, `${name}.mjs`), {
    plugins: [
      {
        name: 'prisma-paths',
        setup: (b) => {
          b.onResolve({ filter: /^\.\/generated\/client$/ }, () => ({ path: join(here, 'generated/workerd/client.ts') }))
          b.onResolve({ filter: /\.wasm\?module$/ }, ({ path }) => ({ path: `./${path.split('/').pop()!.replace(/\?module$/, '')}`, external: true }))
        },
      },
    ],
  })
  copyFileSync(join(here, 'generated/workerd/internal', WASM), join(work, WASM))
  return (bindings: Record<string, string>, compatibilityFlags: string[] = []) =>
    new Miniflare({
      modulesRoot: work,
      modules: [
        { type: 'ESModule', path: join(work, `${name}.mjs`) },
        { type: 'CompiledWasm', path: join(work, WASM) },
      ],
      compatibilityDate: '2026-04-01',
      compatibilityFlags,
      bindings,
    })
}

test('Prisma inside workerd (miniflare), with and without nodejs_compat', async () => {
  const worker = await prismaWorker(join(here, 'worker.ts'), 'worker')
  for (const nodejsCompat of [false, true]) {
    const mf = worker({ PROXY_PORT: String(proxy.port), DATABASE_URL: DATABASE_URL() }, nodejsCompat ? ['nodejs_compat'] : [])
    try {
      for (let i = 0; i < 2; i++) {
        const res = await within(60_000, 'a Prisma request', mf.dispatchFetch(`http://worker.test/?tag=w${Number(nodejsCompat)}${i}-${process.pid}`))
        const body: any = await res.json()
        assert.equal(res.status, 200, `request ${i} ${nodejsCompat ? 'with' : 'without'} nodejs_compat: ${JSON.stringify(body)}`)
        assert.deepEqual(body.steps, ['crud', 'relations', 'batch transaction', 'interactive transaction', 'rollback', 'raw', 'P2002', 'cleanup'])
      }
      await eventually(() => proxy.sessionCount === 0, "the Worker's sessions closed (ctx.waitUntil)")
    } finally {
      await mf.dispose()
    }
  }
})

test("docs/driver.md's Prisma Worker, bundled (its generated client the workerd one) and run in workerd", async () => {
  const entry = join(here, `doc-worker-${process.pid}.mjs`)
  writeFileSync(entry, docBlock('docs/driver.md', 'PrismaPg').code)
  const worker = await prismaWorker(entry, 'doc-worker').finally(() => rmSync(entry, { force: true }))
  const mf = worker({ WS_PROXY: proxy.url, DATABASE_URL: DATABASE_URL() })
  try {
    const res = await within(60_000, 'the Prisma Worker', mf.dispatchFetch('http://worker.test/'))
    const body = await res.text()
    assert.equal(res.status, 200, body)
    assert.ok(Array.isArray(JSON.parse(body)), `users with their posts: ${body}`)
    await eventually(() => proxy.sessionCount === 0, "the Worker's sessions closed (ctx.waitUntil)")
  } finally {
    await mf.dispose()
  }
})
