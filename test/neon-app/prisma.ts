// A Prisma app written for @neondatabase/serverless, unchanged, with edgepg installed under Neon's
// name: @prisma/adapter-neon's PrismaNeon (WebSocket Pool) and PrismaNeonHttp (neon()). Run and
// type-checked by test/neon-alias.test.ts; ops.ts is test/prisma/ops.ts. Prints one JSON line.
import { neonConfig } from '@neondatabase/serverless'
import { PrismaNeon, PrismaNeonHttp } from '@prisma/adapter-neon'
import ws from 'ws'
import { PrismaClient, Prisma } from './generated/client.ts'
import { runOps } from './ops.ts'

const { DATABASE_URL, PROXY } = process.env as Record<string, string>
neonConfig.webSocketConstructor = ws
neonConfig.wsProxy = () => `${PROXY.replace(/^http/, 'ws')}/v2`
neonConfig.fetchEndpoint = `${PROXY}/sql`

const prisma = new PrismaClient({ adapter: new PrismaNeon({ connectionString: DATABASE_URL }) })
const out: Record<string, unknown> = {}
try {
  out.ws = await runOps(prisma, Prisma, `neon-ws-${process.pid}`)
} finally {
  await prisma.$disconnect()
}

// Over HTTP there are no transactions (Prisma's own rule for neon()): one request per statement.
const http = new PrismaClient({ adapter: new PrismaNeonHttp(DATABASE_URL, {}) })
const email = `http-${process.pid}@example.test`
const steps: string[] = []
// (A nested write would need a transaction: a user, then its post.)
const user = await http.user.create({ data: { email, name: 'Hal' } })
await http.post.create({ data: { title: 'over HTTP', authorId: user.id } })
const withPosts = await http.user.findUnique({ where: { id: user.id }, include: { posts: true } })
if (withPosts?.posts[0]?.title === 'over HTTP') steps.push('create, include')
const found = await http.post.findMany({ where: { author: { email } }, include: { author: true } })
if (found.length === 1 && found[0].author.name === 'Hal') steps.push('relation filter')
const raw = await http.$queryRaw<{ n: number }[]>`SELECT ${41}::int + 1 AS n`
if (raw[0].n === 42) steps.push('raw')
const duplicate = await http.user.create({ data: { email } }).then(() => undefined, (err: unknown) => err)
// PrismaNeonHttp hands the driver's error to Prisma as it is: with Neon's own driver too, a known request error with Postgres's code.
if (duplicate instanceof Prisma.PrismaClientKnownRequestError && duplicate.code === '23505') steps.push('23505')
else console.error('duplicate:', duplicate?.constructor?.name, (duplicate as any)?.code, String(duplicate))
await http.post.deleteMany({ where: { authorId: user.id } })
if ((await http.user.deleteMany({ where: { email } })).count === 1) steps.push('cleanup')
out.http = steps
console.log(JSON.stringify(out))
