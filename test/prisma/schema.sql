-- The tables schema.prisma describes (made with SQL: prisma migrate needs Prisma's schema engine, a download).
DROP TABLE IF EXISTS "Post";
DROP TABLE IF EXISTS "User";
CREATE TABLE "User" (id serial PRIMARY KEY, email text NOT NULL, name text);
CREATE UNIQUE INDEX "User_email_key" ON "User" (email);
CREATE TABLE "Post" (
  id serial PRIMARY KEY,
  title text NOT NULL,
  published boolean NOT NULL DEFAULT false,
  "authorId" integer NOT NULL REFERENCES "User" (id) ON DELETE RESTRICT ON UPDATE CASCADE
);
