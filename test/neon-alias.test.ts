/**
 * Moving from Neon in one line, as a user does it: the packed tarball installed under Neon's name
 * in a fresh project (package.json as docs/neon.md says, `overrides` included),
 * with Drizzle's neon-serverless and neon-http drivers and Prisma's Neon adapters from the registry,
 * unchanged. The app in test/neon-app/ runs against edgepg-proxy and is type-checked with the
 * project's own `tsc`.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import pg from 'pg'
import { startProxy, pgConfig, scratchTable } from './support/helpers'
import { PASSWORD } from './support/stack'
import { docBlock } from './support/doc-blocks'
import { packedTarball } from './support/pack'

const run = promisify(execFile)
const root = fileURLToPath(new URL('..', import.meta.url))
const work = mkdtempSync(join(tmpdir(), 'edgepg-neon-app-'))
const app = join(work, 'app')
const PRISMA_DB = `neon_prisma_${process.pid}`
const version = (name: string) => JSON.parse(readFileSync(join(root, 'node_modules', name, 'package.json'), 'utf8')).version

let proxy: Awaited<ReturnType<typeof startProxy>>
let scratch: Awaited<ReturnType<typeof scratchTable>>

before(async () => {
  proxy = await startProxy()
  scratch = await scratchTable('neon_app', 'tag text NOT NULL, name text NOT NULL')
  const tarball = await packedTarball()
  cpSync(join(root, 'test/neon-app'), app, { recursive: true })
  // docs/neon.md's package.json, with the packed tarball where the page has the published version.
  const shown = JSON.parse(docBlock('docs/neon.md', 'overrides').code)
  assert.equal(shown.dependencies['@neondatabase/serverless'], 'npm:edgepg@^0.1.0')
  const pkg = {
    name: 'neon-app',
    private: true,
    type: 'module',
    ...shown,
    dependencies: {
      ...shown.dependencies,
      '@neondatabase/serverless': `file:${tarball}`,
      'drizzle-orm': version('drizzle-orm'),
      '@prisma/adapter-neon': version('@prisma/adapter-neon'),
      '@prisma/client': version('@prisma/client'),
      ws: version('ws'),
    },
    devDependencies: { typescript: version('typescript'), '@types/ws': version('@types/ws'), '@types/node': version('@types/node') },
  }
  writeFileSync(join(app, 'package.json'), JSON.stringify(pkg, null, 2))
  await run('npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error'], { cwd: app, timeout: 240_000 })
  // Prisma: its client generated into the app (as test/prisma.test.ts does, without the schema
  // engine it would download), its tables in a database of their own.
  cpSync(join(root, 'test/prisma/ops.ts'), join(app, 'ops.ts'))
  const standIn = join(work, 'no-schema-engine')
  writeFileSync(standIn, '#!/bin/sh\nexit 1\n', { mode: 0o755 })
  await run(join(root, 'node_modules/.bin/prisma'), ['generate', '--schema', join(app, 'schema.prisma')], {
    cwd: app,
    env: { ...process.env, PRISMA_SCHEMA_ENGINE_BINARY: standIn, CHECKPOINT_DISABLE: '1', PRISMA_HIDE_UPDATE_MESSAGE: '1' },
    timeout: 120_000,
  })
  await scratch.tcp.query(`CREATE DATABASE ${PRISMA_DB}`)
  const db = new pg.Client({ ...pgConfig('scram_user'), database: PRISMA_DB })
  await db.connect()
  await db.query(readFileSync(join(root, 'test/prisma/schema.sql'), 'utf8'))
  await db.end()
})

after(async () => {
  await scratch?.tcp.query(`DROP DATABASE IF EXISTS ${PRISMA_DB} WITH (FORCE)`)
  await scratch?.drop()
  await proxy?.close()
  rmSync(work, { recursive: true, force: true })
})

test("npm installs the tarball under Neon's name, once, for the app, Drizzle and Prisma's adapter", async () => {
  const { stdout } = await run('npm', ['ls', '@neondatabase/serverless', '--all', '--json'], { cwd: app })
  const installed = JSON.parse(readFileSync(join(app, 'node_modules/@neondatabase/serverless/package.json'), 'utf8'))
  assert.equal(installed.name, 'edgepg')
  assert.ok(!stdout.includes('"version": "1.'), `no copy of Neon's own driver anywhere: ${stdout}`)
})

test('Drizzle neon-serverless and neon-http, unchanged, on edgepg: one backend per transaction, a rollback loses nothing else, db.batch', async () => {
  const { host, port, database } = pgConfig('scram_user') as { host: string; port: number; database: string }
  const env = { ...process.env, DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`, PROXY: `http://127.0.0.1:${proxy.port}`, TABLE: scratch.name }
  const { stdout } = await run(process.execPath, [join(root, 'node_modules/tsx/dist/cli.mjs'), 'drizzle.ts'], { cwd: app, env, timeout: 60_000 })
  const out = JSON.parse(stdout.trim().split('\n').pop()!)
  assert.deepEqual(out, { rollback: 'boom', seenInside: 1, samePid: true, batch: ['batched'], neonDbError: '22012' })
  const rows = (await scratch.tcp.query(`SELECT tag, name FROM ${scratch.name} ORDER BY tag, name`)).rows
  assert.deepEqual(rows, [
    { tag: 'http', name: 'batched' },
    { tag: 'ws', name: 'committed' },
    { tag: 'ws', name: 'other request' },
  ], 'over TCP: the committed rows and the other request’s insert; nothing of the rolled-back transaction')
})

test("Prisma's PrismaNeon (WebSocket Pool) and PrismaNeonHttp (neon()), unchanged, on edgepg", async () => {
  const { host, port } = pgConfig('scram_user') as { host: string; port: number }
  const env = { ...process.env, DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${PRISMA_DB}`, PROXY: `http://127.0.0.1:${proxy.port}` }
  const { stdout } = await run(process.execPath, [join(root, 'node_modules/tsx/dist/cli.mjs'), 'prisma.ts'], { cwd: app, env, timeout: 120_000 })
  assert.deepEqual(JSON.parse(stdout.trim().split('\n').pop()!), {
    ws: ['crud', 'relations', 'batch transaction', 'interactive transaction', 'rollback', 'raw', 'P2002', 'cleanup'],
    http: ['create, include', 'relation filter', 'raw', '23505', 'cleanup'],
  })
})

test('tsc type-checks the app against the installed types with no casts, and refuses what Neon’s types refuse', async () => {
  await run(process.execPath, [join(root, 'node_modules/typescript/bin/tsc'), '-p', '.'], { cwd: app, timeout: 120_000 }).catch((err) => {
    assert.fail(`tsc failed:\n${err.stdout}${err.stderr}`)
  })
})
